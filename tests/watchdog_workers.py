"""What the processes of tests/test_watchdog.py run: a run stuck in one phase.

Each function trains the toy model (tests/toy.py) with a :class:`loopkit.observe.Watchdog`
and gets stuck on purpose; the watchdog ends the process (it never returns).
"""

import time

import jax
import numpy as np

import loopkit
from tests import multihost_workers, toy

STUCK_SECS = 120.0  # how long a stuck piece sleeps: far past every deadline and test timeout


def _watchdog(workdir: str, **deadlines) -> loopkit.observe.Watchdog:
  return loopkit.observe.Watchdog(deadlines, poll_secs=0.1, workdir=workdir)


def stuck_device_call(workdir: str, stuck_step: int = 6) -> None:
  """A step whose host callback sleeps at ``stuck_step``: the device call never ends."""
  base = toy.make_global_step()

  def nap(step):
    if int(step) == stuck_step:
      print(f"step {stuck_step}'s host callback sleeps", flush=True)
      time.sleep(STUCK_SECS)

  def step_fn(state, batch):
    jax.debug.callback(nap, state["step"] + 1)
    return base(state, batch)

  goodput = loopkit.observe.GoodputHook(workdir=workdir, log_summary=False)
  loop = loopkit.TrainLoop(step_fn, iterations_per_loop=2,
                           hooks=[goodput, _watchdog(workdir, device_call=2.0)])
  loop.run(toy.init_state(), toy.batches(12), num_steps=12)
  raise AssertionError("the watchdog did not end the run")


class BlockingSource:
  """Batches from tests/toy.py, then blocks for good before batch ``block_at``."""

  def __init__(self, block_at: int):
    self.data = toy.batches(20)
    self.block_at = block_at

  def __iter__(self):
    for i, batch in enumerate(self.data):
      if i == self.block_at:
        print(f"the source blocks before batch {i}", flush=True)
        time.sleep(STUCK_SECS)
      yield batch


def blocking_source(workdir: str) -> None:
  """The source blocks before batch 7: the run waits for its next chunk."""
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2,
                           hooks=[_watchdog(workdir, data=2.0)])
  loop.run(toy.init_state(), BlockingSource(7), num_steps=20)
  raise AssertionError("the watchdog did not end the run")


def straggler(workdir: str, stuck_process: int = 1, stuck_step: int = 6) -> None:
  """``stuck_process`` stops answering (a hook that sleeps) after step ``stuck_step``.

  The others wait for its answer at the next boundary agreement; their watchdogs
  (agreement deadline 2 s) name it. The stuck process's own watchdog has no deadline for
  hooks (``hooks=None``), so it stays stuck, as a live process whose heartbeats go on.
  """
  def nap(info, state):
    del state
    if jax.process_index() == stuck_process:
      print(f"process {stuck_process} stops answering after step {info.end_step}", flush=True)
      time.sleep(STUCK_SECS)

  hook = loopkit.CallbackHook(nap, at_steps=[stuck_step], at_end=False, needs_state=False)
  multihost_workers.train(60, 3, extra_hooks=[hook, _watchdog(workdir, agreement=2.0,
                                                               hooks=None)])
  raise AssertionError("the watchdog did not end the run")


class Nothing(loopkit.Hook):
  """A hook that does nothing (the baseline: a run with one hook)."""

  needs_state = False


def overhead(calls: int = 400) -> dict:
  """Seconds per device call of a tiny run with one hook that does nothing, without and with
  a watchdog (best of 3 each)."""
  data = toy.batches(calls)
  out: dict[str, float] = {}
  for name in ("without", "with", "without", "with", "without", "with"):
    hooks = [Nothing(at_end=False)] + ([loopkit.observe.Watchdog()] if name == "with" else [])
    loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=1, hooks=hooks)
    loop.run(toy.init_state(), data[:2], num_steps=2)  # compile
    t0 = time.perf_counter()
    loop.run(toy.init_state(), data, num_steps=calls)
    secs = (time.perf_counter() - t0) / calls
    out[name] = min(out.get(name, np.inf), secs)
  return out
