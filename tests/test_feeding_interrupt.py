"""Stopping while a chunk is being formed from a slow source: preemption, hook errors, exit.

The sources here read their first chunk at once and then sleep per batch, so a
preemption lands while the second chunk ``[K, B, ...]`` is half formed. Before
the feeder could abandon a chunk, the loop waited for the whole chunk (K batch
times) and then for the prefetch thread, and a prefetch thread left inside JAX
at interpreter exit aborted the process (rc 134, "FATAL: exception not
rethrown").
"""

import os
import signal
import subprocess
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from loopkit.checkpoint import CheckpointHook
from loopkit.data import feeding
from loopkit.data.feeding import ChunkFeeder
from tests import bootstrap, toy

MESH2 = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
REPL2 = NamedSharding(MESH2, P())
BATCH_SECS = 0.4  # a slow batch
K = 12
N = 48  # batches in a source
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_batch(i: int) -> dict:
  """Batch i: the ints [2i, 2i+1] and a regression pair from them (B = 2)."""
  rng = np.random.default_rng(i)
  x = rng.normal(size=(2, 4)).astype(np.float32)
  return {"i": np.array([2 * i, 2 * i + 1], np.int32), "x": x,
          "y": (x @ np.ones((4, 2), np.float32)).astype(np.float32)}


def train_step(state, batch):
  """The toy regression update, and ``seen[step] = batch["i"]`` (the batch consumed)."""
  loss, grads = jax.value_and_grad(toy.loss_fn)(state["params"], batch)
  updates, opt = toy.TX.update(grads, state["opt"], state["params"])
  seen = state["seen"].at[state["step"]].set(jax.sharding.reshard(batch["i"], REPL2))
  return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
           "step": state["step"] + 1, "seen": seen}, {"loss": loss})


def init_state() -> dict:
  state = toy.init_state()
  state["seen"] = jnp.full((N, 2), -1, jnp.int32)
  return state


def make_loop(hooks=(), prefetch=2) -> loopkit.TrainLoop:
  return loopkit.TrainLoop(train_step, iterations_per_loop=K, hooks=list(hooks),
                           prefetch=prefetch, mesh=MESH2)


class SlowBatches:
  """Re-iterable batches 0..N-1 (a counted position); batches >= ``slow_from`` take
  ``secs`` each; SIGINT to this process when batch ``signal_at`` starts.

  ``handled``: a callable that is true once the signal was handled (the loop's
  preemption flag); the batch in flight then lasts until it is (at most 10 s),
  so the batch count does not depend on how late a loaded machine runs the
  main thread's handler (a batch of 0.4 s was not always enough under load).
  """

  def __init__(self, slow_from=K, secs=BATCH_SECS, signal_at=None, handled=None):
    self.slow_from, self.secs, self.signal_at = slow_from, secs, signal_at
    self.handled = handled
    self.pulled = 0
    self.signal_time = None

  def __iter__(self):
    for i in range(N):
      self._read(i)
      yield make_batch(i)

  def _read(self, i):
    if i == self.signal_at:
      self.signal_time = time.monotonic()
      os.kill(os.getpid(), signal.SIGINT)
      deadline = time.monotonic() + 10.0
      while self.handled is not None and not self.handled() and time.monotonic() < deadline:
        time.sleep(0.01)
    if i >= self.slow_from:
      time.sleep(self.secs)
    self.pulled = i + 1


class SlowStateIterator(SlowBatches):
  """The same batches as an iterator with Grain-style ``get_state``/``set_state``."""

  def __init__(self, **kw):
    super().__init__(**kw)
    self.next = 0

  def __iter__(self):
    return self

  def __next__(self):
    if self.next >= N:
      raise StopIteration
    self._read(self.next)
    self.next += 1
    return make_batch(self.next - 1)

  def get_state(self):
    return {"next": self.next}

  def set_state(self, state):
    self.next = state["next"]


SOURCES = {"counted": SlowBatches, "iterator_state": SlowStateIterator}
POSITION_AT_12 = {"counted": 12, "iterator_state": {"next": 12}}


class Ends(loopkit.Hook):
  needs_state = False

  def __init__(self):
    super().__init__(at_end=False)
    self.ends = []

  def after_each_call(self, info):
    self.ends.append(info.end_step)


assert_bitwise = toy.assert_bitwise


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("kind", ["counted", "iterator_state"])
def test_sigint_while_a_chunk_forms_stops_within_a_batch(kind, prefetch):
  """K=12; SIGINT as batch 14 starts (the 3rd of steps 13-24): stop at 12 in one batch time.

  Before: the loop formed batches 14..23 first (10 x 0.4 s = 4 s), then stopped.
  """
  ends = Ends()
  loop = make_loop([ends], prefetch=prefetch)
  src = SOURCES[kind](signal_at=14, handled=lambda: loop.preemption.requested)
  before = signal.getsignal(signal.SIGINT)  # whatever the process had (pytest's, or SIG_IGN)
  state = loop.run(init_state(), src, num_steps=N)
  elapsed = time.monotonic() - src.signal_time
  print(f"{kind} prefetch={prefetch}: run returned {elapsed:.2f} s after SIGINT")
  assert loop.status == "preempted" and loop.preemption.signal_received == signal.SIGINT
  assert loop.ledger.step == 12 and int(state["step"]) == 12 and ends.ends == [12]
  assert elapsed < 2.5  # the batch in flight (0.4 s) may finish; the chunk (4 s) is not formed
  assert src.pulled == 15  # batches 12, 13, 14 were read into the abandoned chunk ...
  assert loop.data_position == POSITION_AT_12[kind]  # ... and are not in the position
  seen = np.asarray(state["seen"])
  np.testing.assert_array_equal(seen[:12].ravel(), np.arange(24))
  assert (seen[12:] == -1).all()
  assert signal.getsignal(signal.SIGINT) is before  # the run put the previous handler back


@pytest.mark.parametrize("kind", ["counted", "iterator_state"])
def test_resume_after_an_abandoned_chunk_continues_with_the_next_batch(tmp_path, kind):
  """Preempted at 12 with batches 12-14 read and abandoned; the resume reads 12 next."""
  ref = make_loop().run(init_state(), SOURCES[kind](secs=0.0), num_steps=30)
  hook = CheckpointHook(tmp_path, every_steps=100)
  loop = make_loop([hook])
  loop.run(init_state(), SOURCES[kind](signal_at=14), num_steps=30)
  assert loop.status == "preempted" and hook.saved_steps == [12]
  assert hook.restore(init_state(), 12).data_position == POSITION_AT_12[kind]
  again = CheckpointHook(tmp_path, every_steps=100)
  resumed = make_loop([again])
  final = resumed.run(init_state(), SOURCES[kind](secs=0.0), num_steps=30)
  assert again.restored_step == 12 and again.saved_steps == [30]
  assert resumed.status == "completed"
  assert resumed.data_position == {"counted": 30, "iterator_state": {"next": 30}}[kind]
  seen = np.asarray(final["seen"])
  np.testing.assert_array_equal(seen[:30].ravel(), np.arange(60))  # each batch once, in order
  assert (seen[30:] == -1).all()
  assert_bitwise(final, ref)  # params and optimizer state too


class Boom(Exception):
  pass


def test_hook_exception_surfaces_without_waiting_for_the_source():
  """A hook raises at step 12 while the producer sleeps 3 s in batch 12: it surfaces at once.

  Before: ``close`` waited for the thread (up to 5 s) before the exception left ``run``.
  """
  src = SlowBatches(secs=3.0)
  raised = {}

  def fail(info, state):
    raised["time"], raised["pulled"] = time.monotonic(), src.pulled
    raise Boom(f"hook failed at step {info.end_step}")

  loop = make_loop([loopkit.CallbackHook(fail, at_steps=[12])])
  with pytest.raises(Boom, match="hook failed at step 12"):
    loop.run(init_state(), src, num_steps=N)
  surfaced = time.monotonic() - raised["time"]
  print(f"hook exception surfaced {surfaced:.3f} s after the raise")
  assert surfaced < 1.5  # not after the 3 s batch (bounds generous for loaded CI machines)
  stranded = [t for t, _, _ in feeding._STRANDED if t.is_alive()]
  assert [t.name for t in stranded] == ["loopkit-prefetch"]  # still in the source ...
  stranded[0].join(timeout=10)
  assert not stranded[0].is_alive()  # ... it ends when the batch in flight returns
  assert src.pulled <= raised["pulled"] + 1  # and reads nothing after it


def test_producer_places_nothing_after_close(monkeypatch):
  """A producer that leaves the source after ``close`` places no partial chunk (no JAX call).

  Before: it stacked and placed the batches read so far, so at interpreter exit
  it could be inside ``jax.device_put``'s C++ code, which aborts the process.
  """
  placements = []
  real_device_put = jax.device_put

  def spy(*args, **kwargs):
    placements.append(threading.current_thread().name)
    return real_device_put(*args, **kwargs)

  monkeypatch.setattr(jax, "device_put", spy)
  src = SlowBatches(slow_from=3, secs=0.5)
  sharding = NamedSharding(MESH2, P(None, "data"))
  feeder = ChunkFeeder(iter(src), iter([3, 3, 3]), iterations_per_loop=3,
                       batch_sharding=sharding, replicated=REPL2, data_parallel_size=2,
                       prefetch=1)
  first = feeder.next()
  np.testing.assert_array_equal(np.asarray(first.batches["i"]).reshape(-1), np.arange(6))
  assert first.position == 3
  time.sleep(0.2)  # the producer sleeps in batch 3, the first of the next chunk
  t0 = time.perf_counter()
  feeder.close(wait_secs=0.0)
  assert time.perf_counter() - t0 < 0.5  # close(wait_secs=0) does not wait for the batch
  feeder._thread.join(timeout=10)
  assert not feeder._thread.is_alive()
  assert src.pulled == 4  # batch 3 finished, batch 4 never started
  assert placements == ["loopkit-prefetch"]  # the first chunk only


def test_interrupt_returns_an_interrupted_chunk_while_the_source_is_busy():
  """``next`` answers an interrupt within its poll, not after the batch in flight."""
  src = SlowBatches(slow_from=3, secs=2.5)
  interrupt = threading.Event()
  sharding = NamedSharding(MESH2, P(None, "data"))
  feeder = ChunkFeeder(iter(src), iter([3, 3, 3]), iterations_per_loop=3,
                       batch_sharding=sharding, replicated=REPL2, data_parallel_size=2,
                       prefetch=2, interrupt=interrupt)
  assert feeder.next().length == 3
  time.sleep(0.1)
  interrupt.set()
  t0 = time.perf_counter()
  chunk = feeder.next()
  waited = time.perf_counter() - t0
  assert chunk.interrupted and chunk.length == 0 and chunk.batches is None
  assert chunk.position is None and not chunk.exhausted
  assert waited < 1.2  # the batch in flight still has ~2.4 s to go
  feeder.close()
  assert not feeder._thread.is_alive() and src.pulled == 4


EXIT_SCRIPT = textwrap.dedent("""
  import os, signal, sys, threading, time
  import numpy as np
  import loopkit
  from loopkit.data import feeding
  from tests import toy
  feeding.CLOSE_TIMEOUT_SECS = 0.5

  def train_step(state, batch):
    return toy.make_global_step()(state, batch)

  data = toy.batches(8, batch_size=2)

  # 1. a hook raises while the source sleeps 1.5 s: run() raises at once; exit waits for it.
  def slow_source():
    for i, b in enumerate(data):
      if i >= 2:
        time.sleep(1.5)
      yield b

  raised_at = []
  def fail(info, state):
    raised_at.append(time.monotonic())
    raise RuntimeError("hook failed")

  loop = loopkit.TrainLoop(train_step, iterations_per_loop=2,
                           hooks=[loopkit.CallbackHook(fail, at_steps=[2])])
  try:
    loop.run(toy.init_state(), slow_source(), num_steps=8)
  except RuntimeError as e:
    print("raised", e, round(time.monotonic() - raised_at[0], 2), flush=True)

  # 2. SIGINT, then the source blocks for good: run() returns after the bounded wait.
  never = threading.Event()
  def blocking_source():
    for i, b in enumerate(data):
      if i == 2:
        time.sleep(1.0)  # the loop has agreed on steps 1-2 and dispatched them
        os.kill(os.getpid(), signal.SIGINT)
        never.wait(600)
      yield b

  loop = loopkit.TrainLoop(train_step, iterations_per_loop=2)
  t0 = time.monotonic()
  loop.run(toy.init_state(), blocking_source(), num_steps=8)
  print("returned", loop.status, loop.ledger.step, loop.data_position,
        round(time.monotonic() - t0, 1), flush=True)
""")


def test_interpreter_exits_cleanly_with_the_source_still_blocked(tmp_path):
  """run() returns while the prefetch thread is inside the source: the process exits 0.

  Exit waits (bounded) for a thread that leaves the source and warns about one that
  does not; neither is ever inside JAX's C++ code while the interpreter finalizes.
  """
  script = tmp_path / "exit_check.py"
  script.write_text(EXIT_SCRIPT)
  t0 = time.monotonic()
  proc = subprocess.run(bootstrap.command(script, devices=2), capture_output=True, text=True,
                        timeout=120, cwd=REPO, env=bootstrap.env())
  wall = time.monotonic() - t0
  print(f"exit check: rc {proc.returncode} in {wall:.1f} s")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "FATAL" not in proc.stderr and "terminate called" not in proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("raised hook failed ")
  assert float(lines[0].split()[-1]) < 1.2  # not after the 1.5 s batch
  status, step, position, secs = lines[1].split()[1:]
  assert (status, step, position) == ("preempted", "2", "2")
  assert float(secs) < 5.0
  # The blocked source is named twice: when run() gives up on it, and at exit.
  assert proc.stderr.count("still inside next()") == 2, proc.stderr[-3000:]
  assert proc.stderr.count("blocking_source") == 2
  assert "slow_source" not in proc.stderr  # that one ended within the wait at exit
