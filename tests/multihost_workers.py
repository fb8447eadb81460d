"""Functions run by every process of the multi-process tests (tests/test_multihost.py).

Each runs either inside a child of :func:`loopkit.tools.testing.run_processes` (P
processes x D devices under ``jax.distributed``) or directly in the test
process (1 process x 8 devices), so the two can be compared. They return
plain picklable values (numpy arrays, lists, dicts).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import jax
import numpy as np

import loopkit
from loopkit.data import sources
from tests import toy

GLOBAL_BATCH = 16
NUM_EXAMPLES = 160  # 10 steps per epoch at GLOBAL_BATCH


def dataset(num_examples: int = NUM_EXAMPLES, seed: int = 0) -> dict[str, np.ndarray]:
  """The toy regression data (the whole dataset, identical on every process)."""
  rng = np.random.default_rng(seed)
  true_w = rng.normal(size=(4, 2)).astype(np.float32)
  x = rng.normal(size=(num_examples, 4)).astype(np.float32)
  return {"x": x, "y": (x @ true_w).astype(np.float32)}


def host_value(x: jax.Array) -> np.ndarray:
  """A replicated (possibly not fully addressable) array as numpy."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    assert x.is_fully_replicated, x.sharding
    return np.asarray(x.addressable_data(0))
  return np.asarray(x)


def summary(loop: loopkit.TrainLoop, state, losses, seen) -> dict:
  return {
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "device_count": jax.device_count(),
      "local_device_count": jax.local_device_count(),
      "params": {k: host_value(v) for k, v in state["params"].items()},
      "step": int(host_value(state["step"])),
      "ledger_step": loop.ledger.step,
      "examples_seen": loop.ledger.examples_seen,
      "status": loop.status,
      "losses": losses,
      "seen": seen,
      "compiles": loop.program.compile_count(),
  }


class RecordingSource:
  """An :class:`~loopkit.data.sources.ArraySource` that records which examples it served."""

  def __init__(self, src: sources.ArraySource):
    self.src = src
    self.steps_per_epoch = src.steps_per_epoch
    self.served: list[list[int]] = []

  def batch_at(self, step: int):
    self.served.append(self.src.indices_at(step).tolist())
    return self.src.batch_at(step)


def train(num_steps: int = 12, iterations_per_loop: int = 5, style: str = "global", *,
          extra_hooks=(), loops: list | None = None, **loop_kwargs) -> dict:
  """Trains the toy model on :class:`~loopkit.data.sources.ArraySource` batches.

  Every process passes the same arrays; each feeds its ``B / P`` rows of each
  global batch. Returns the final parameters, per-step losses and the example
  indices this process fed, per step. ``loops``, if given, receives the loop
  (so hooks can reach it); ``loop_kwargs`` go to ``TrainLoop``.
  """
  step = toy.make_global_step() if style == "global" else toy.make_per_device_step()
  src = RecordingSource(sources.ArraySource(dataset(), GLOBAL_BATCH, seed=3))
  losses: list[float] = []
  hook = loopkit.CallbackHook(lambda info, _: losses.extend(info.traces["loss"].tolist()),
                              needs_state=False)
  loop = loopkit.TrainLoop(step, iterations_per_loop=iterations_per_loop, step_style=style,
                           hooks=[hook, *extra_hooks], steps_per_epoch=src.steps_per_epoch,
                           **loop_kwargs)
  if loops is not None:
    loops.append(loop)
  state = loop.run(toy.init_state(), src, num_steps=num_steps)
  return summary(loop, state, losses, src.served)


# -- harness -----------------------------------------------------------------------


def topology(tag: str, *, scale: int = 1) -> dict:
  """What a process sees of the distributed runtime, plus a cross-process all-gather."""
  from jax.experimental import multihost_utils

  gathered = multihost_utils.process_allgather(np.int32(jax.process_index() * scale))
  return {"tag": tag, "process_index": jax.process_index(),
          "process_count": jax.process_count(), "device_count": jax.device_count(),
          "local_is_slice": jax.local_devices() == jax.devices()[
              jax.process_index() * jax.local_device_count():
              (jax.process_index() + 1) * jax.local_device_count()],
          "device_processes": [d.process_index for d in jax.devices()],
          "platform": jax.devices()[0].platform, "gathered": np.asarray(gathered).tolist(),
          "collectives": jax.config.jax_cpu_collectives_implementation}


def fail_on(process_id: int, message: str) -> str:
  """Raises on ``process_id``; the others wait (the harness must kill them)."""
  if jax.process_index() == process_id:
    raise ValueError(message)
  time.sleep(120)
  return "not reached"


def sleep(secs: float) -> None:
  time.sleep(secs)


# -- training variants, writers ----------------------------------------------------------


class _Lines:
  """Collects the ``loopkit`` logger's messages."""

  def __init__(self):
    import logging
    self.lines: list[str] = []
    self.logger = logging.getLogger("loopkit")
    self.handler = logging.Handler()
    self.handler.emit = lambda record: self.lines.append(record.getMessage())
    self.logger.addHandler(self.handler)
    self.level = self.logger.level
    self.logger.setLevel(logging.INFO)

  def close(self) -> list[str]:
    self.logger.removeHandler(self.handler)
    self.logger.setLevel(self.level)
    return self.lines


def train_observed(logdir: str, num_steps: int = 12, iterations_per_loop: int = 5) -> dict:
  """:func:`train` with the usual observers: writers, LoggingHook, ProgressHook.

  Every process passes the *same* ``logdir``; the progress stream of process i
  goes to ``logdir/progress_<i>.txt`` (so an empty file shows it stayed quiet).
  """
  from loopkit.observe.progress import ProgressHook
  from loopkit.observe.writers import create_default_writer

  lines = _Lines()
  writer = create_default_writer(logdir, asynchronous=True, console=True)
  with open(os.path.join(logdir, f"progress_{jax.process_index()}.txt"), "w") as stream:
    hooks = [loopkit.LoggingHook(writer, every_steps=5),
             ProgressHook(stream=stream, use_bar=False, log_every_secs=0.0)]
    out = train(num_steps, iterations_per_loop, extra_hooks=hooks)
  writer.close()
  out["log_lines"] = lines.close()
  return out


def train_variants(variants: list[tuple], logdir: str | None = None) -> list[dict]:
  """Several :func:`train` runs in one process group (saves start-up time).

  Args:
    variants: ``(num_steps, iterations_per_loop, style)`` tuples, or with a fourth item, a
      dict of ``TrainLoop`` keyword arguments.
    logdir: if given, the first run is :func:`train_observed` into it.
  """
  out = []
  for i, (n, k, style, *kwargs) in enumerate(variants):
    if i == 0 and logdir is not None:
      assert style == "global"
      out.append(train_observed(logdir, n, k))
    else:
      out.append(train(n, k, style, **(kwargs[0] if kwargs else {})))
  return out


# -- data shards and exact evaluation (C27) -------------------------------------------------


def shards_and_eval(num_examples: int = 10, global_batch: int = 8) -> dict:
  """Each process's shard of ``num_examples`` and an exact evaluation over all of them.

  The eval step returns per-example ``2 * x`` and ``x`` (x = the example index),
  so the totals are exact: sum(2 * x) over 0..N-1 and the count N.
  """
  from jax.sharding import NamedSharding, PartitionSpec as P

  from loopkit.evaluation import Evaluator

  data = {"x": np.arange(num_examples, dtype=np.float32)}
  bounds = sources.process_shard_bounds(num_examples)
  mine = sources.shard_for_process(data)
  num_batches = sources.eval_batches_per_process(num_examples, global_batch)
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  state = jax.device_put(np.float32(2.0), NamedSharding(mesh, P()))

  def eval_step(scale, batch):
    return {"scaled": batch["x"] * scale, "x": batch["x"]}

  evaluator = Evaluator(eval_step, iterations_per_loop=1, mesh=mesh,
                        global_batch_size=global_batch)
  local = global_batch // jax.process_count()
  results = []
  for _ in range(2):  # a second evaluation reuses the executable
    r = evaluator.evaluate(state, sources.batch_arrays(mine, local, num_batches=num_batches),
                           num_batches=num_batches)
    results.append({"metrics": r.metrics, "totals": r.totals, "num_examples": r.num_examples,
                    "num_batches": r.num_batches, "num_calls": r.num_calls})
  return {"process_index": jax.process_index(), "bounds": bounds,
          "examples": mine["x"].astype(int).tolist(), "num_batches": num_batches,
          "eval": results, "compiles": evaluator.compile_count()}


# -- checkpoints and preemption -----------------------------------------------------------


def _state_like():
  """The toy state placed on this run's global mesh (what a restore fills in)."""
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=1)
  return loop.program.place_state(toy.init_state())


def train_checkpointed(directory: str, num_steps: int, iterations_per_loop: int = 3,
                       every_steps: int = 6) -> dict:
  """Trains to ``num_steps`` with a :class:`~loopkit.checkpoint.CheckpointHook`.

  Resumes from the latest checkpoint in ``directory`` if there is one (written
  by any number of processes). Also returns what the latest checkpoint held
  before the run (``restored``: params as numpy, or None).
  """
  from loopkit.checkpoint import CheckpointHook

  probe = CheckpointHook(directory)
  before = probe.latest_step()
  restored = None
  if before is not None:
    r = probe.restore(_state_like())
    restored = {"step": r.step, "data_position": r.data_position,
                "params": {k: host_value(v) for k, v in r.state["params"].items()}}
  probe.close()
  ckpt = CheckpointHook(directory, every_steps=every_steps)
  out = train(num_steps, iterations_per_loop, extra_hooks=[ckpt])
  out.update(restored=restored, restored_step=ckpt.restored_step,
             saved_steps=list(ckpt.saved_steps), all_steps=ckpt.all_steps())
  ckpt.close()
  return out


def checkpoint_directory_claims(locked: str, failed: str, delay_s: float = 3.0) -> dict:
  """Cases C46 and item 9 on every process.

  ``locked`` holds a live lock of another run: every process's ``run`` must fail
  at start with the same message, before any step. In ``failed`` (holding
  ``8.orbax-checkpoint-tmp``), process 1 reaches the failed save's removal
  ``delay_s`` late: process 0 must remove the directory only after that.
  """
  from etils import epath

  from loopkit.checkpoint import CheckpointError, CheckpointHook, files as checkpoint_files

  t0 = time.monotonic()
  try:
    train(6, 3, extra_hooks=[CheckpointHook(locked, every_steps=3)])
    error = None
  except CheckpointError as e:
    error = str(e)
  refused_s = time.monotonic() - t0
  removed_at = []
  original = checkpoint_files._remove_tmp_dirs

  def recording(directory, step):
    removed_at.append(time.time())
    original(directory, step)

  checkpoint_files._remove_tmp_dirs = recording
  if jax.process_index() == 1:
    time.sleep(delay_s)  # still draining this process's writers
  arrived_at = time.time()
  checkpoint_files._remove_failed_save(epath.Path(failed), 8)
  checkpoint_files._remove_tmp_dirs = original
  return {"error": error, "refused_s": refused_s, "arrived_at": arrived_at,
          "removed_at": removed_at, "left": sorted(os.listdir(failed))}


def train_until_sigterm(directory: str, marker_dir: str, wait_step: int = 4,
                        num_steps: int = 12, iterations_per_loop: int = 3) -> dict:
  """Trains with checkpoints every 6 steps; process 1 waits at ``wait_step`` for SIGTERM.

  At ``wait_step`` process 1 writes ``marker_dir/ready`` and blocks until its
  preemption flag is set (the test sends SIGTERM to it alone). Process 0 goes
  on and meets process 1 at the next boundary's agreement, so both must stop
  at ``wait_step`` and save it, although 6 is the cadence.
  """
  from loopkit.checkpoint import CheckpointHook

  loops: list[loopkit.TrainLoop] = []

  def wait_for_sigterm(info, state):
    del state
    if jax.process_index() != 1:
      return None
    with open(os.path.join(marker_dir, "ready"), "w") as f:
      f.write(str(info.end_step))
    deadline = time.monotonic() + 60
    while not loops[0].preemption.requested:
      if time.monotonic() > deadline:
        raise TimeoutError("no SIGTERM arrived within 60 s")
      time.sleep(0.01)
    return None

  ckpt = CheckpointHook(directory, every_steps=6)
  waiter = loopkit.CallbackHook(wait_for_sigterm, at_steps=[wait_step], at_end=False)
  out = train(num_steps, iterations_per_loop, extra_hooks=[waiter, ckpt], loops=loops)
  watcher = loops[0].preemption
  out.update(saved_steps=list(ckpt.saved_steps), all_steps=ckpt.all_steps(),
             signal_received=watcher.signal_received, requested=watcher.requested,
             sigterm_handler_restored=signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
  return out


def train_and_die(die_process: int, die_step: int = 4, exit_code: int = 17) -> dict:
  """Trains; ``die_process`` exits abruptly (``os._exit``) after step ``die_step``."""
  def die(info, state):
    del state
    if jax.process_index() == die_process:
      print(f"process {die_process} exits at step {info.end_step}", flush=True)
      os._exit(exit_code)

  hook = loopkit.CallbackHook(die, at_steps=[die_step], at_end=False)
  return train(1000, 3, extra_hooks=[hook])


# -- preemption while a chunk is read from a slow source ------------------------------------

SLOW_K = 8  # iterations_per_loop: a chunk of the slow source takes SLOW_K * secs to form
SLOW_STEPS = 24


def numbered_batch(i: int) -> dict[str, np.ndarray]:
  """Global batch i: example ids ``[16 i, 16 i + 16)`` as int32 ``"i"`` [16], and a
  float32 regression pair ``"x"`` [16, 4], ``"y"`` [16, 2] drawn from seed i."""
  rng = np.random.default_rng(1000 + i)
  true_w = np.random.default_rng(0).normal(size=(4, 2)).astype(np.float32)
  x = rng.normal(size=(GLOBAL_BATCH, 4)).astype(np.float32)
  return {"i": np.arange(GLOBAL_BATCH * i, GLOBAL_BATCH * (i + 1), dtype=np.int32), "x": x,
          "y": (x @ true_w).astype(np.float32)}


def slow_shard(num_batches: int, secs: float, stats: dict, slow_from: int = SLOW_K,
               marker_dir: str | None = None, mark_at: int | None = None,
               gate: threading.Event | None = None):
  """A generator of this process's rows of global batches 0..num_batches-1.

  Batches ``>= slow_from`` sleep ``secs`` before they are yielded (a slow
  reader). ``stats["pulled"]`` counts the batches read so far. As batch
  ``mark_at`` starts, the file ``marker_dir/reading_<process>`` is written
  with ``time.time()`` (so the test can signal while the chunk is half read).
  Batch ``slow_from`` is read only once ``gate`` is set (if given).

  Raises:
    TimeoutError: ``gate`` not set within 60 s.
  """
  p, local = jax.process_index(), GLOBAL_BATCH // jax.process_count()
  for i in range(num_batches):
    if gate is not None and i == slow_from and not gate.wait(60):
      raise TimeoutError("the first call did not complete within 60 s")
    if marker_dir is not None and i == mark_at:
      path = os.path.join(marker_dir, f"reading_{p}")
      with open(path + ".tmp", "w") as f:
        f.write(repr(time.time()))
      os.replace(path + ".tmp", path)  # the test never reads a partial file
    if i >= slow_from:
      time.sleep(secs)
    stats["pulled"] = i + 1
    yield {k: v[p * local:(p + 1) * local] for k, v in numbered_batch(i).items()}


def seen_step(state, batch):
  """The toy update, and ``seen[step] = batch["i"]`` (the global batch consumed at step)."""
  new, metrics = toy.make_global_step()(
      {k: state[k] for k in ("params", "opt", "step")}, batch)
  new["seen"] = state["seen"].at[state["step"]].set(batch["i"])
  return new, metrics


def seen_init_state(num_steps: int = SLOW_STEPS) -> dict:
  state = toy.init_state()
  state["seen"] = np.full((num_steps, GLOBAL_BATCH), -1, np.int32)
  return state


class StopClock(loopkit.Hook):
  """Records ``time.time()`` and the step when the run's last boundary is handled.

  Put it first in the hook list: at a preemption its ``on_trigger`` runs as soon
  as the processes agree to stop, before the checkpoint is written.
  """

  needs_state = False

  def __init__(self):
    super().__init__(at_steps=[10**9], at_end=True)  # only at the end
    self.time: float | None = None
    self.step: int | None = None

  def on_trigger(self, info, state):
    del state
    self.time, self.step = time.time(), info.end_step


def _slow_summary(loop: loopkit.TrainLoop, state, stats: dict) -> dict:
  return {"process_index": jax.process_index(), "status": loop.status,
          "step": int(host_value(state["step"])), "ledger_step": loop.ledger.step,
          "data_position": loop.data_position, "pulled": stats["pulled"],
          "state": jax.tree.map(host_value, state), "compiles": loop.program.compile_count()}


def train_slow_until_sigterm(directory: str, marker_dir: str, secs: float = 0.3,
                             mark_at: int = SLOW_K + 2, num_steps: int = SLOW_STEPS,
                             cache_dir: str | None = None) -> dict:
  """Trains K = 8 from :func:`slow_shard` (``secs`` per batch after the first chunk).

  The second chunk (batches 8-15) is read only after the first call (which
  compiles) has completed, so the main thread waits in the feeder while it
  forms. The test sends SIGTERM once ``marker_dir/reading_<p>`` exists, i.e.
  while batch ``mark_at`` of that chunk is being read. The checkpoint hook's
  cadence (1000) is never reached: it saves only at the preemption's boundary.
  Times are ``time.time()`` (comparable with the test process's clock). ``cache_dir``:
  a persistent compilation cache (:func:`use_compilation_cache`) for :func:`resume_slow`.
  """
  from loopkit.checkpoint import CheckpointHook

  if cache_dir is not None:
    use_compilation_cache(cache_dir)
  stats = {"pulled": 0}
  clock = StopClock()
  first_call_done = threading.Event()
  gate = loopkit.CallbackHook(lambda info, state: first_call_done.set(), at_steps=[SLOW_K],
                              at_end=False)  # needs_state: fires as the call completes
  ckpt = CheckpointHook(directory, every_steps=1000)
  loop = loopkit.TrainLoop(seen_step, iterations_per_loop=SLOW_K, hooks=[clock, gate, ckpt])
  source = slow_shard(num_steps, secs, stats, marker_dir=marker_dir, mark_at=mark_at,
                      gate=first_call_done)
  state = loop.run(seen_init_state(num_steps), source, num_steps=num_steps)
  returned = time.time()
  out = _slow_summary(loop, state, stats)
  out.update(stop_time=clock.time, stop_step=clock.step, return_time=returned,
             saved_steps=list(ckpt.saved_steps), all_steps=ckpt.all_steps(),
             signal_received=loop.preemption.signal_received,
             requested=loop.preemption.requested)
  ckpt.close()
  return out


def resume_slow(directory: str, num_steps: int = SLOW_STEPS,
                cache_dir: str | None = None) -> dict:
  """Resumes :func:`train_slow_until_sigterm`'s checkpoint to ``num_steps`` (fast source),
  then trains the same steps uninterrupted from the start (``reference``).

  ``restored`` is what the latest checkpoint held before the resume (as numpy).
  ``cache_dir``: the compilation cache :func:`train_slow_until_sigterm` filled.
  """
  from loopkit.checkpoint import CheckpointHook

  if cache_dir is not None:
    use_compilation_cache(cache_dir)
  probe = CheckpointHook(directory)
  like = loopkit.TrainLoop(seen_step, iterations_per_loop=1).program.place_state(
      seen_init_state(num_steps))
  r = probe.restore(like)
  restored = {"step": r.step, "data_position": r.data_position,
              "state": jax.tree.map(host_value, r.state)}
  probe.close()
  stats = {"pulled": 0}
  ckpt = CheckpointHook(directory, every_steps=1000)
  loop = loopkit.TrainLoop(seen_step, iterations_per_loop=SLOW_K, hooks=[ckpt])
  state = loop.run(seen_init_state(num_steps), slow_shard(num_steps, 0.0, stats),
                   num_steps=num_steps)
  out = _slow_summary(loop, state, stats)
  out.update(restored=restored, restored_step=ckpt.restored_step,
             saved_steps=list(ckpt.saved_steps))
  ckpt.close()
  ref_stats = {"pulled": 0}
  ref_loop = loopkit.TrainLoop(seen_step, iterations_per_loop=SLOW_K)
  ref = ref_loop.run(seen_init_state(num_steps), slow_shard(num_steps, 0.0, ref_stats),
                     num_steps=num_steps)
  out["reference"] = _slow_summary(ref_loop, ref, ref_stats)
  return out


def wall_clock_hooks(directory: str, repeats: int = 20, num_steps: int = 24,
                     slow_secs: float = 0.15, cache_dir: str | None = None) -> dict:
  """Case C30: ``every_secs`` hooks on processes whose clocks and speeds differ.

  Per repeat: K = 2, 24 steps; process 0 spends ``slow_secs`` in a hook every 6
  steps; a ``CallbackHook(every_secs=0.3)`` and a ``CheckpointHook(every_secs=0.3)``
  (its own directory per repeat). Returns, per repeat, the steps each fired at
  (on this process), and the measured cost of one agreement.
  ``cache_dir``: JAX's persistent compilation cache (:func:`use_compilation_cache`):
  every repeat's new TrainLoop compiles the same programs, loaded from it from the
  second repeat on.
  """
  from loopkit.core.agreement import agree

  if cache_dir is not None:
    use_compilation_cache(cache_dir)
  out: dict = {"callback": [], "saved": [], "status": []}
  for r in range(repeats):
    fired: list[int] = []
    slow = loopkit.CallbackHook(
        lambda info, _: time.sleep(slow_secs) if jax.process_index() == 0 else None,
        every_steps=6, at_end=False, needs_state=False)
    timed = loopkit.CallbackHook(lambda info, _, fired=fired: fired.append(info.end_step),
                                 every_secs=0.3, at_end=False, needs_state=False)
    ckpt = loopkit.CheckpointHook(os.path.join(directory, str(r)), every_secs=0.3)
    loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2,
                             hooks=[slow, timed, ckpt])
    loop.run(toy.init_state(), sources.ArraySource(dataset(), GLOBAL_BATCH, seed=r),
             num_steps=num_steps)
    out["callback"].append(fired)
    out["saved"].append(list(ckpt.saved_steps))
    out["status"].append((loop.status, loop.ledger.step))
  try:  # a time-based K decides from this process's clock: refused on several processes
    loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop="1s")
  except ValueError as e:
    out["time_based_k_error"] = str(e)
  flags = [False, False, True, False]
  agree(flags)  # warm up
  t0 = time.perf_counter()
  for _ in range(100):
    agree(flags)
  out["agree_secs"] = (time.perf_counter() - t0) / 100
  return out


def stop_reasons(plans: list[dict[int, str]]) -> list[tuple]:
  """Item 9: a stop requested on some processes reads the same on every process.

  One loop (K = 2), one run of 8 steps per plan; a hook requests a stop at step 4 on the
  processes of the plan, each with its own reason. Returns ``(status, ledger step)`` per run.
  """
  plan: dict[int, str] = {}

  def ask(info, _):
    reason = plan.get(jax.process_index())
    if info.end_step == 4 and reason is not None:
      loop.request_stop(reason)

  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2,
                           hooks=[loopkit.CallbackHook(ask, needs_state=False)])
  out = []
  for p in plans:
    plan.clear()
    plan.update(p)
    loop.run(toy.init_state(), sources.ArraySource(dataset(), GLOBAL_BATCH), num_steps=8)
    out.append((loop.status, loop.ledger.step))
  return out


# -- the ResNet example: preemption and resume on 2 processes ---------------------------------


def use_compilation_cache(cache_dir: str) -> None:
  """JAX's persistent compilation cache in ``cache_dir``, for every program, on every process.

  JAX writes entries from process 0 only (``jax._src.compiler._cache_write``), and on CPU
  a process's cache keys hash its own devices, so process 1 never finds process 0's
  entries: process 1 would compile every program anew in every run. Here every process
  other than 0 writes its own entries (its keys, so no two processes write one file),
  through JAX's ``compilation_cache.put_executable_and_time``; where JAX's private
  ``_cache_write`` has another form, process 1 just compiles (slower, same results).
  """
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  if jax.process_index() == 0:
    return
  import inspect

  from jax._src import compilation_cache, compiler

  original = getattr(compiler, "_cache_write", None)
  names = ("cache_key", "compile_time_secs", "module_name", "backend", "executable")
  if original is None or getattr(original, "writes_every_process", False) or tuple(
      inspect.signature(original).parameters)[:5] != names:
    return
  signature = inspect.signature(original)

  def cache_write(*args, **kwargs):
    a = signature.bind(*args, **kwargs).arguments
    if a.get("host_callbacks"):  # as JAX: not cacheable
      return None
    return compilation_cache.put_executable_and_time(
        a["cache_key"], a["module_name"], a["executable"], a["backend"],
        int(a["compile_time_secs"]))

  cache_write.writes_every_process = True  # type: ignore[attr-defined]
  compiler._cache_write = cache_write


def tiny_resnet_config(data_dir: str, num_steps: int, checkpoint_every_steps: int = 4):
  """``examples/resnet50/configs/cpu.py`` (digits) shrunk for a default-suite test.

  ResNet-18 with 2 base filters on the native 8x8 digits, global batch 16
  (2 per device on 8), K = 2, a checkpoint every ``checkpoint_every_steps``
  (0: no checkpoints), no periodic eval (the example's exact eval of the 360
  test digits runs once at the end).
  """
  from examples.resnet50.configs import cpu

  config = cpu.get_config()
  config.data_dir = data_dir
  config.image_size = 8
  config.model.num_filters = 2
  config.global_batch_size = 16
  config.num_train_steps = num_steps
  config.iterations_per_loop = 2
  config.log_every_steps = 2
  config.progress_every_secs = 600.0
  config.eval_every_epochs = 0
  config.checkpoint_every_epochs = 0
  config.checkpoint_every_steps = checkpoint_every_steps
  return config


class WaitForPreemption(loopkit.Hook):
  """At ``at_step``: writes ``marker_dir/ready_<process>``, then waits for the SIGTERM.

  Blocks at that boundary (``needs_state``: no later call is in flight) until
  this process's preemption flag is set, so the run stops at ``at_step``
  whatever the machine's speed.

  Raises:
    TimeoutError: no preemption within ``timeout_s`` seconds.
  """

  def __init__(self, at_step: int, marker_dir: str, timeout_s: float = 120.0):
    super().__init__(at_steps=[at_step], at_end=False)
    self.marker_dir, self.timeout_s = marker_dir, timeout_s
    self.loop = None

  def on_run_start(self, loop, state):
    del state
    self.loop = loop

  def on_trigger(self, info, state):
    del state
    path = os.path.join(self.marker_dir, f"ready_{jax.process_index()}")
    with open(path + ".tmp", "w") as f:
      f.write(str(info.end_step))
    os.replace(path + ".tmp", path)
    deadline = time.monotonic() + self.timeout_s
    while not self.loop.preemption.requested:
      if time.monotonic() > deadline:
        raise TimeoutError(f"no SIGTERM arrived within {self.timeout_s} s")
      time.sleep(0.01)


def resnet_example(workdir: str, data_dir: str, num_steps: int, *,
                   wait_at_step: int | None = None, marker_dir: str | None = None,
                   cache_dir: str | None = None, checkpoint_every_steps: int = 4) -> dict:
  """``examples.resnet50.train.train_and_evaluate`` on :func:`tiny_resnet_config`.

  Resumes from ``workdir/checkpoints`` if there are any (the example's own
  behaviour). With ``wait_at_step``, waits there for a SIGTERM
  (:class:`WaitForPreemption`). ``cache_dir``: JAX's persistent compilation
  cache, for
  every program (also the small initialisation ones), written and read by
  both processes (:func:`use_compilation_cache`).

  The initial weights are drawn with JAX's ``unsafe_rbg`` PRNG instead of the
  default threefry: the model's eager initialisation (36 small programs) took
  33 s to compile with threefry on this machine's 2 loaded CPU cores, 5 s
  with ``unsafe_rbg``.
  Nothing else draws random numbers (the train step takes no key; the input
  pipeline shuffles with its own seeds), so the run is otherwise the
  example's.

  Returns:
    The example's summary (``status``, ``step``, ``ledger``, ``restored_step``,
    ...) with the final ``state`` as numpy, the checkpoint steps on disk
    (``checkpoints``), and the preemption watcher's ``signal_received``.
  """
  from examples.resnet50 import train

  jax.config.update("jax_default_prng_impl", "unsafe_rbg")
  if cache_dir is not None:
    use_compilation_cache(cache_dir)
  hooks = [] if wait_at_step is None else [WaitForPreemption(wait_at_step, marker_dir)]
  config = tiny_resnet_config(data_dir, num_steps, checkpoint_every_steps)
  r = train.train_and_evaluate(config, workdir, extra_hooks=hooks)
  r["state"] = jax.tree.map(host_value, r["state"])
  ckpts = os.path.join(workdir, "checkpoints")
  r["checkpoints"] = sorted(int(d) for d in os.listdir(ckpts) if d.isdigit()) if (
      os.path.isdir(ckpts)) else []
  r["signal_received"] = hooks[0].loop.preemption.signal_received if hooks else None
  return r


def resnet_resume_and_reference(workdir: str, reference_workdir: str, data_dir: str,
                                num_steps: int, cache_dir: str | None = None) -> list[dict]:
  """:func:`resnet_example` twice: the resume in ``workdir``, then an uninterrupted run
  in ``reference_workdir`` (without checkpoints: they cost ~5 s here and change nothing)."""
  return [resnet_example(workdir, data_dir, num_steps, cache_dir=cache_dir),
          resnet_example(reference_workdir, data_dir, num_steps, cache_dir=cache_dir,
                         checkpoint_every_steps=0)]


def main(argv: list[str]) -> None:
  """A ``python -m`` entry point: writes ``<dir>/main_<process>.json``; ``argv = [dir, tag]``."""
  import json

  out_dir, tag = argv
  with open(os.path.join(out_dir, f"main_{jax.process_index()}.json"), "w") as f:
    json.dump(topology(tag), f)
  raise SystemExit(0)  # what absl.app.run does at the end


if __name__ == "__main__":
  import sys

  main(sys.argv[1:])


# -- the agreement (tests/test_agreement.py) -------------------------------------------------


def _agreements() -> list:
  """Three agreements with answers that differ by process."""
  from loopkit.core import agreement  # pylint: disable=g-import-not-at-top
  me = jax.process_index()
  return [agreement.agree([me == 0, me == 1, False]),
          list(agreement.agree_with_reason([False], "from 1" if me == 1 else None)),
          list(agreement.agree_with_reason([me == 0], f"from {me}")),
          agreement.agree([])]


def _while_a_program_runs(seconds: float = 2.0) -> dict:
  """Dispatches a local program of about ``seconds``, agrees while it runs, then waits for it."""
  from loopkit.core import agreement  # pylint: disable=g-import-not-at-top
  w = jax.numpy.full((512, 512), 1e-3, jax.numpy.float32)
  body = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda i, y: jax.numpy.tanh(y @ w), x))
  x = jax.numpy.ones((512, 512), jax.numpy.float32)
  body(x, 2).block_until_ready()  # compile; then size n to about `seconds`
  t0 = time.perf_counter()
  body(x, 20).block_until_ready()
  n = max(20, int(20 * seconds / max(time.perf_counter() - t0, 1e-6)))
  agreement.agree([False])  # both processes have compiled and sized before timing
  out = body(x, n)
  t0 = time.perf_counter()
  agreement.agree([jax.process_index() == 1])
  agree_secs = time.perf_counter() - t0
  ready_when_agreed = out.is_ready()
  out.block_until_ready()
  return {"agree_secs": agree_secs, "ready_when_agreed": ready_when_agreed,
          "program_secs": time.perf_counter() - t0}


def agreement_paths() -> dict:
  """The agreement through the coordination service and through devices, and a late process."""
  from loopkit._internal import compat  # pylint: disable=g-import-not-at-top
  from loopkit.core import agreement  # pylint: disable=g-import-not-at-top
  out = {"has_client": compat.coordination_client() is not None,
         "service": _agreements(), "service_in_flight": _while_a_program_runs()}
  for _ in range(200):  # then only the last blocks of 64 agreements' keys are in the store
    agreement.agree([False])
  keys = [k for k, _ in compat.coordination_client().key_value_dir_get("loopkit/agreement/")]
  out["rounds_in_store"] = sorted({int(k.split("/")[-2]) for k in keys})
  saved = compat.coordination_client
  compat.coordination_client = lambda: None  # the fallback: process_allgather
  try:
    out["devices"] = _agreements()
    out["devices_in_flight"] = _while_a_program_runs()
  finally:
    compat.coordination_client = saved
  # process 1 answers 3 s late; process 0 waits 1 s and names it
  if jax.process_index() == 1:
    time.sleep(3.0)
    agreement.agree([True])
    out["late"] = None
  else:
    try:
      agreement.agree_with_reason([True], None, timeout_secs=1.0)
      out["late"] = None
    except agreement.AgreementError as e:
      out["late"] = str(e)
  return out
