"""ProgressHook: plain lines off a TTY (exact, with an injected clock), a tqdm bar on a TTY,
silence on processes other than 0; in a real pty (120 and 0 columns): one frame per boundary,
smoothed rates, the compile left out of the ETA, plain lines without a width."""

import io
import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from loopkit.observe import progress
from tests import bootstrap, toy


def step_fn(state, batch):
  return ({"w": state["w"] + jnp.mean(batch["x"]), "step": state["step"] + 1},
          {"loss": jnp.mean(batch["x"])})


def init():
  return {"w": jnp.zeros((), jnp.float32), "step": jnp.zeros((), jnp.int32)}


def batches(n, b=16):
  return [{"x": np.full((b, 2), float(i), np.float32)} for i in range(n)]


FakeClock, Tick = toy.FakeClock, toy.Tick


class TtyStream(io.StringIO):
  def isatty(self):
    return True


def run(progress, clock, *, n=100, k=10, secs_per_step=1.0, extra=()):
  hooks = [Tick(clock, secs_per_step), progress, *extra]
  loop = loopkit.TrainLoop(step_fn, iterations_per_loop=k, hooks=hooks)
  loop.run(init(), batches(n), num_steps=n)
  return loop


def test_plain_lines_when_not_a_tty():
  """100 steps, K=10, 1 s per step, batch 16, a line at most every 25 s, and one at the end."""
  clock, out = FakeClock(), io.StringIO()
  run(loopkit.ProgressHook(stream=out, log_every_secs=25.0, clock=clock), clock)
  assert out.getvalue().splitlines() == [
      "step 0/100: waiting for the first batches, then compiling the first device call",
      "step 30/100 (30.0%): 1.0 steps/s, 16.0 examples/s, ETA 0:01:10",
      "step 60/100 (60.0%): 1.0 steps/s, 16.0 examples/s, ETA 0:00:40",
      "step 90/100 (90.0%): 1.0 steps/s, 16.0 examples/s, ETA 0:00:10",
      "step 100/100 (100.0%): 1.0 steps/s, 16.0 examples/s, ETA 0:00:00",
  ]


def test_rates_follow_the_clock_and_lines_can_go_to_a_logger(caplog):
  clock = FakeClock()
  hook = loopkit.ProgressHook(log_every_secs=0.0, logger=logging.getLogger("loopkit"),
                              clock=clock, stream=io.StringIO())
  with caplog.at_level(logging.INFO, logger="loopkit"):
    run(hook, clock, n=30, k=10, secs_per_step=0.25)
  assert caplog.messages == [  # the first call compiled: no rate from it
      "step 0/30: waiting for the first batches, then compiling the first device call",
      "step 10/30 (33.3%): ? steps/s, ? examples/s, ETA ?",
      "step 20/30 (66.7%): 4.0 steps/s, 64.0 examples/s, ETA 0:00:02",
      "step 30/30 (100.0%): 4.0 steps/s, 64.0 examples/s, ETA 0:00:00",
  ]


def test_early_stop_gets_a_final_line():
  clock, out = FakeClock(), io.StringIO()
  stopper = loopkit.CallbackHook(lambda info, s: loop_ref[0].request_stop(), needs_state=False,
                                 at_steps=[40], at_end=False)
  hook = loopkit.ProgressHook(stream=out, log_every_secs=1000.0, clock=clock)
  loop_ref = []
  loop = loopkit.TrainLoop(step_fn, iterations_per_loop=10,
                           hooks=[Tick(clock, 1.0), hook, stopper])
  loop_ref.append(loop)
  loop.run(init(), batches(100), num_steps=100)
  assert loop.ledger.step in (40, 50)  # stops at the next boundary (one call late at most)
  assert out.getvalue().splitlines() == [
      "step 0/100: waiting for the first batches, then compiling the first device call",
      f"step {loop.ledger.step}/100 ({loop.ledger.step:.1f}%): 1.0 steps/s, 16.0 examples/s, "
      f"ETA 0:00:{100 - loop.ledger.step:02d}"]


def test_bar_on_a_tty():
  clock, out = FakeClock(), TtyStream()
  run(loopkit.ProgressHook(stream=out, clock=clock), clock, n=40, k=10)
  text = out.getvalue()
  assert "40/40" in text
  last = text.split("\r")[-1]  # the final frame: a fixed 20-character bar, the last call's loss
  assert re.fullmatch(r"step 40/40 \|(#|\u2588){20}\| 100%, 1.0 steps/s, ETA 0:00:00, "
                      r"loss=34.5\n", last), last
  assert text.count("steps/s") == text.count("ETA ")  # one rate per frame, the ETA labelled
  assert "step 40/40 (" not in text  # no plain lines in bar mode


def test_silent_on_other_processes(monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  clock = FakeClock()
  for stream in (io.StringIO(), TtyStream()):
    hook = loopkit.ProgressHook(stream=stream, log_every_secs=0.0, clock=clock)
    run(hook, clock, n=20, k=10)
    assert stream.getvalue() == ""
    assert hook.lines == []


def test_total_steps_override_and_eta_format():
  clock, out = FakeClock(), io.StringIO()
  run(loopkit.ProgressHook(total_steps=3620, stream=out, log_every_secs=1e9, clock=clock), clock,
      n=20, k=10)
  assert out.getvalue().splitlines() == [
      "step 0/3620: waiting for the first batches, then compiling the first device call",
      "step 20/3620 (0.6%): 1.0 steps/s, 16.0 examples/s, ETA 1:00:00"]
  from loopkit.observe.progress import format_eta
  assert format_eta(59.6) == "0:01:00"
  assert format_eta(float("nan")) == "?"


@pytest.mark.parametrize("k", [1, 3, 7])
def test_one_line_per_boundary_never_repeats_a_step(k):
  clock, out = FakeClock(), io.StringIO()
  run(loopkit.ProgressHook(stream=out, log_every_secs=0.0, clock=clock), clock, n=10, k=k)
  steps = [int(line.split()[1].split("/")[0]) for line in out.getvalue().splitlines()[1:]]
  expected = list(range(k, 10, k)) + [10]
  assert steps == expected


def test_a_run_that_raises_closes_the_bar_and_gives_the_console_back():
  """The bar's line is ended (the traceback starts on a line of its own) and sys.stdout,
  sys.stderr are the console again, not the bar's stand-ins."""
  import sys

  from loopkit._internal import logs

  def boom(info, state):
    raise RuntimeError(f"stop at step {info.end_step}")

  clock, out = FakeClock(), TtyStream()
  console = sys.stdout, sys.stderr
  bar = loopkit.ProgressHook(stream=out, metric_names=(), clock=clock)
  with pytest.raises(RuntimeError, match="stop at step 30"):
    run(bar, clock, n=100, k=10, extra=[loopkit.CallbackHook(boom, at_steps=[30], at_end=False,
                                                             needs_state=False)])
  assert (sys.stdout, sys.stderr) == console and logs._above is None
  assert bar._bar is None
  last = out.getvalue().rsplit("\r", 1)[-1]
  assert last.startswith("step 30/100 |") and last.endswith("\n"), repr(out.getvalue())


# -- in a real pseudo-terminal ----------------------------------------------------------------
# A subprocess trains 100 steps, K = 10 (10 boundaries), global batch 8, on a fake clock: the
# first call costs 100 s (a slow compile), then calls alternate 1.5 s and 0.5 s (10 steps/s on
# average, 3x swings from one boundary to the next, as host timings jitter on a steady run); the
# boundaries are 0.12 s apart in real time, so tqdm would draw on its own at an update().
PTY_SCRIPT = """\
import sys
import time
import jax.numpy as jnp
import numpy as np
import loopkit
from tests import toy

def train_step(state, batch):
  return {"step": state["step"] + 1, "w": state["w"] + jnp.mean(batch["x"])}, {
      "loss": jnp.mean(batch["x"])}

def cost(step):  # seconds of step `step` (1-based)
  call = (step - 1) // 10
  return 10.0 if call == 0 else 0.15 if call % 2 else 0.05

class RealPause(loopkit.Hook):  # boundaries 0.12 s apart in real time, past tqdm's mininterval
  needs_state = False

  def after_each_call(self, info):
    time.sleep(0.12)

clock = toy.FakeClock()
hooks = [RealPause(), toy.Tick(clock, cost),
         loopkit.ProgressHook(log_every_secs=3.0, metric_names=(), clock=clock)]
if CHECKPOINT:
  hooks.append(loopkit.CheckpointHook(sys.argv[1], every_steps=50))
loop = loopkit.TrainLoop(train_step, iterations_per_loop=10, hooks=hooks)
loop.run({"step": jnp.zeros((), jnp.int32), "w": jnp.zeros((), jnp.float32)},
         [{"x": np.full((8, 2), float(i), np.float32)} for i in range(100)], num_steps=100)
"""
CALL_SECS = [100.0] + [1.5 if i % 2 else 0.5 for i in range(1, 10)]  # boundaries 0..9


def run_in_pty(tmp_path, columns: int, checkpoint: bool) -> str:
  """Runs PTY_SCRIPT with stdout and stderr on a pty of ``columns`` columns; its output."""
  import fcntl
  import os
  import pty
  import struct
  import subprocess
  import termios
  master, slave = pty.openpty()
  fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
  env = bootstrap.env(COLUMNS="", LINES="")
  code = PTY_SCRIPT.replace("CHECKPOINT", str(checkpoint))
  proc = subprocess.Popen(bootstrap.command("-c", code, tmp_path / "ckpt", devices=1),
                          stdin=slave, stdout=slave, stderr=slave, env=env, cwd=str(tmp_path))
  os.close(slave)
  chunks = []
  while True:
    try:
      chunk = os.read(master, 65536)
    except OSError:  # EIO: the child closed the pty
      break
    if not chunk:
      break
    chunks.append(chunk)
  os.close(master)
  assert proc.wait(timeout=300) == 0, b"".join(chunks).decode(errors="replace")
  return b"".join(chunks).decode().replace("\r\n", "\n")


def smoothed_rates(secs, steps=10, a=0.3):
  """tqdm's smoothing, written out: EMA(steps) / EMA(secs) over the calls after the first."""
  rates, ema = [math.nan], None
  for dt in secs[1:]:
    ema = (steps, dt) if ema is None else (a * steps + (1 - a) * ema[0], a * dt + (1 - a) * ema[1])
    rates.append(ema[0] / ema[1])
  return rates


@pytest.mark.parametrize("checkpoint", [False, True], ids=["hooks", "with-CheckpointHook"])
def test_bar_in_a_120_column_pty_draws_once_per_boundary(tmp_path, checkpoint):
  text = run_in_pty(tmp_path, 120, checkpoint)
  frames = re.findall(r"\r(step \d+/100 \|[^\r\n]*)", text)
  shown = [f for i, f in enumerate(frames) if i == 0 or f != frames[i - 1]]  # repaints dropped
  steps = [int(re.match(r"step (\d+)", f).group(1)) for f in shown]
  assert steps == list(range(10, 101, 10)), frames  # one frame per boundary, in order
  if not checkpoint:  # no log line redraws the bar: each boundary once, and tqdm's closing repaint
    assert len(frames) == 11 and frames[-1] == frames[-2], frames
  parsed = [re.search(r"\| +\d+%, (\S+) steps/s, ETA (\S+)$", f.rstrip()) for f in shown]
  assert all(parsed), shown
  rates = [m.group(1) for m in parsed]
  expected = smoothed_rates(CALL_SECS)
  assert rates == [progress.format_rate(r) for r in expected], rates
  assert parsed[0].group(2) == "?"  # only the compiling call measured: no ETA yet
  # The first ETA is the remaining 80 steps at the first measured call's speed (12 s), not at
  # the compile's (run start to step 20: 101.5 s for 20 steps, ETA 0:06:46).
  assert parsed[1].group(2) == "0:00:12"
  # A steady run: after the first two measured calls the rate stays within 25% of the average
  # speed (10 steps/s), where the calls' own speeds swing 6.7 <-> 20 steps/s.
  assert all(7.5 <= float(r) <= 12.5 for r in rates[2:]), rates


def test_a_0_column_pty_gets_plain_lines_every_log_every_secs(tmp_path):
  text = run_in_pty(tmp_path, 0, checkpoint=False)
  assert "\r" not in text and "|" not in text, text  # no bar frames
  lines = [line for line in text.splitlines() if line.startswith("step ")]
  # A line when 3 s have passed since the last one (or the start): the fake clock reads 100,
  # 101.5, 102, 103.5, 104, 105.5, 106, 107.5, 108, 109.5 at boundaries 0..9, and the last.
  rates = smoothed_rates(CALL_SECS)
  expected = ["step 0/100: waiting for the first batches, then compiling the first device call"]
  for b in (0, 3, 7, 9):
    step, r = 10 * (b + 1), rates[b]
    eta = progress.format_eta((100 - step) / r) if step < 100 else "0:00:00"
    expected.append(f"step {step}/100 ({float(step):.1f}%): {progress.format_rate(r)} steps/s, "
                    f"{progress.format_rate(8 * r)} examples/s, ETA {eta}")
  assert lines == expected, text


def test_rate_meter_weighs_intervals_by_time():
  meter = progress.RateMeter(0.3)
  assert all(math.isnan(r) for r in meter.rates())
  for steps, secs in ((10, 1.5), (10, 0.5), (10, 0.0)):  # a 0 s interval is ignored
    meter.add(steps, 8 * steps, secs)
  ema_secs = 0.3 * 0.5 + 0.7 * 1.5
  assert meter.rates() == (10 / ema_secs, 80 / ema_secs)
  total = progress.RateMeter(0.0)  # the average: total steps / total seconds
  for steps, secs in ((10, 1.5), (30, 0.5)):
    total.add(steps, steps, secs)
  assert total.rates() == (20.0, 20.0)
  with pytest.raises(ValueError, match="smoothing must be in \\[0, 1\\], got 1.5"):
    loopkit.ProgressHook(smoothing=1.5)


@pytest.mark.parametrize("use_bar", [False, True], ids=["plain", "bar"])
def test_a_rewind_is_shown_not_a_silent_step_back(tmp_path, use_bar):
  """C80: K=3, a spike at step 13 rewinds to checkpoint 10 and skips data steps 11..15; the
  display says so in one line (plain: among the lines; bar: above the bar, whose next frame
  is at step 10 and says it rewound) before it shows step 13 again."""
  from loopkit.checkpoint import CheckpointHook, LossSpikeHook
  from tests.test_skips import Steps
  out = TtyStream() if use_bar else io.StringIO()
  hook = loopkit.ProgressHook(stream=out, log_every_secs=0.0, clock=FakeClock())
  ckpt = CheckpointHook(tmp_path, every_steps=5, async_save=False)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=3, hooks=[
      hook, ckpt, LossSpikeHook(ckpt, factor=10, window=5, margin=2)])
  loop.run(toy.init_state(), Steps(spike_at=13), num_steps=20)
  rewound = "step 10/20: rewound from step 13 to step 10 (skip_steps [(11, 15)])"
  assert rewound in hook.lines
  text = out.getvalue()
  if not use_bar:
    assert text.splitlines()[1:] == [
        f"step {s}/20 ({5 * s:.1f}%): ? steps/s, ? examples/s, ETA ?" for s in (3, 5, 8, 10, 13)
    ] + [rewound] + [f"step {s}/20 ({5 * s:.1f}%): ? steps/s, ? examples/s, ETA ?"
                     for s in (13, 15, 18)] + [
        "step 20/20 (100.0%): ? steps/s, ? examples/s, ETA 0:00:00"]
    return
  before, after = text.split(rewound + "\n")
  assert before.endswith("\r") and "loss=" in before.rsplit("step 13/20", 1)[1]
  frames = [f for f in after.replace("\n", "\r").split("\r") if f.startswith("step ")]
  steps = [int(f.split()[1].split("/")[0]) for f in frames]
  # tqdm redraws the frame it had under the line, then the bar is at 10 and goes on from there
  assert steps[:2] == [13, 10] and steps[1:] == sorted(steps[1:]) and steps[-1] == 20, frames
  assert frames[1].rstrip().endswith("|  50%, rewound from step 13"), frames
