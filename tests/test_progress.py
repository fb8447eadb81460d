"""ProgressHook: plain lines off a TTY (exact, with an injected clock), a tqdm bar on a TTY,
silence on processes other than 0."""

import io
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopkit
from tests import toy


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
      "step 0/100: compiling the first device call",
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
    run(hook, clock, n=20, k=10, secs_per_step=0.25)
  assert caplog.messages == [
      "step 0/20: compiling the first device call",
      "step 10/20 (50.0%): 4.0 steps/s, 64.0 examples/s, ETA 0:00:02",
      "step 20/20 (100.0%): 4.0 steps/s, 64.0 examples/s, ETA 0:00:00",
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
      "step 0/100: compiling the first device call",
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
      "step 0/3620: compiling the first device call",
      "step 20/3620 (0.6%): 1.0 steps/s, 16.0 examples/s, ETA 1:00:00"]
  from loopkit.progress import format_eta
  assert format_eta(59.6) == "0:01:00"
  assert format_eta(float("nan")) == "?"


@pytest.mark.parametrize("k", [1, 3, 7])
def test_one_line_per_boundary_never_repeats_a_step(k):
  clock, out = FakeClock(), io.StringIO()
  run(loopkit.ProgressHook(stream=out, log_every_secs=0.0, clock=clock), clock, n=10, k=k)
  steps = [int(line.split()[1].split("/")[0]) for line in out.getvalue().splitlines()[1:]]
  expected = list(range(k, 10, k)) + [10]
  assert steps == expected
