"""Where one device call's host time goes: loopkit's per-call path split by phase.

Times ``TrainLoop.run`` on the ``mlp`` workload (dispatch-bound) with
``prefetch=0``, where every phase runs on the main thread and the run's wall
time splits into them, and with ``prefetch=2``, where the first two phases run
on the prefetch thread (their sum is the column ``prefetch CPU``)
and ``handoff`` is the main thread's wait for a chunk. Each phase is one
function of the real path, wrapped by a timer for the measurement only
(exclusive times: a phase's time excludes the phases called inside it):

- ``form``: ``ChunkFeeder._form`` but the placement: pulling K batches from the source (a
  list of numpy batches here), checking each against the first, stacking ``[K, B, ...]``;
- ``place``: ``loopkit.data.placement.Placer`` (the host-to-device transfer of the chunk's leaves);
- ``handoff``: the rest of ``ChunkFeeder.next`` (the queue; with prefetch, waiting for it);
- ``agree``: ``Run.agree`` (the agreement; no communication on 1 process);
- ``dispatch``: ``MultiStepProgram.__call__`` (the jitted call, asynchronous);
- ``finish``: ``Run.finish_call``: the one-late fetch (with no hooks, of the step
  counter and the non-finite flags only), the step check, ``LoopInfo`` and the hooks
  (none in this workload);
- ``ledger``: ``Ledger.advance`` and ``Ledger.add_time``;
- ``loop``: what is left of the main thread's CPU time per call (the loop body itself,
  the ``Boundary`` record, triggers); the phases are timed per call, not per batch.

The timers' own CPU (two ``time.thread_time`` reads and the bookkeeping, about 3.5 us per
timed call on the 2-core CI machine; about 10 timed calls per device call, ``Ledger.add_time``
included) is measured on a timed no-op before each run (best of 5) and taken out of ``loop``
and of ``prefetch CPU``, times the thread's count of timed calls (column ``timers``: what was
taken out of the main thread per call), so ``main CPU`` is loopkit's and not the
measurement's; the best-of calibration takes out at most what the timers cost.

Phases are CPU time of the thread that runs them (``time.thread_time``), so a wait
(for the device, for the queue) costs only its wake-up, and a loaded machine
inflates them less than wall time. ``main CPU`` is the main thread's CPU per call,
``prefetch CPU`` the prefetch thread's phases, ``process CPU`` all threads (XLA's
included), ``wait`` the loop's own ``device_wait`` bucket (wall time in the fetch).
The reference rows: ``bare jit`` is the per-step ``jax.jit`` loop fed numpy batches
(``benchmarks/systems.py``'s "per-step jit, numpy in"), and ``program only`` is
loopkit's compiled program called back to back on one chunk already on the device
(no feeding, no loop), the floor for a call.

Usage (from the repository root)::

  python -m benchmarks.host_profile [--devices 1] [--ks 1 100] [--repeats 5]

The device count is set (fake CPU devices) before JAX starts.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time


def _set_devices(argv: list[str]) -> None:
  n = 1
  if "--devices" in argv:
    n = int(argv[argv.index("--devices") + 1])
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":
  _set_devices(sys.argv)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import loopkit  # noqa: E402
from benchmarks import systems as sy, workloads as wl  # noqa: E402
from loopkit.core import boundary as boundary_lib, ledger as ledger_lib, program as program_lib  # noqa: E402
from loopkit.data import feeding  # noqa: E402

PHASES = ("form", "place", "handoff", "agree", "dispatch", "finish",
          "ledger", "loop")


class Phases:
  """Exclusive CPU time (``time.thread_time``) per phase and thread, from wrapped functions."""

  def __init__(self):
    self.secs = collections.defaultdict(float)  # main thread
    self.producer = collections.defaultdict(float)  # the prefetch thread (prefetch > 0)
    self._local = threading.local()
    self._undo: list[tuple[object, str, object]] = []
    self.calls = collections.Counter()  # timed calls: "main" / "producer"

  def timed(self, fn, phase: str):
    main = threading.main_thread()

    def wrapper(*args, **kwargs):
      stack = self._local.__dict__.setdefault("stack", [])  # per open phase: [child secs]
      stack.append([0.0])
      t0 = time.thread_time()
      try:
        return fn(*args, **kwargs)
      finally:
        dt = time.thread_time() - t0
        child = stack.pop()[0]
        is_main = threading.current_thread() is main
        (self.secs if is_main else self.producer)[phase] += dt - child
        self.calls["main" if is_main else "producer"] += 1
        if stack:
          stack[-1][0] += dt
    return wrapper

  def patch(self, owner, name: str, phase: str) -> None:
    orig = owner.__dict__[name]
    self._undo.append((owner, name, orig))
    setattr(owner, name, self.timed(orig, phase))

  def install(self) -> None:
    self.patch(feeding.ChunkFeeder, "next", "handoff")
    self.patch(feeding.ChunkFeeder, "_form", "form")
    self.patch(feeding._Placer, "__call__", "place")
    self.patch(boundary_lib, "agree", "agree")
    self.patch(program_lib.MultiStepProgram, "__call__", "dispatch")
    self.patch(boundary_lib, "finish_call", "finish")
    self.patch(ledger_lib.Ledger, "advance", "ledger")
    self.patch(ledger_lib.Ledger, "add_time", "ledger")

  def overhead(self, repeats: int = 5, n: int = 20000) -> float:
    """Seconds of thread CPU one timed call adds around a no-op (best of ``repeats``)."""
    def noop():
      return None
    timed = Phases().timed(noop, "form")
    best = float("inf")
    for _ in range(repeats):
      t0 = time.thread_time()
      for _ in range(n):
        timed()
      t1 = time.thread_time()
      for _ in range(n):
        noop()
      best = min(best, ((t1 - t0) - (time.thread_time() - t1)) / n)
    return max(best, 0.0)

  def uninstall(self) -> None:
    for owner, name, orig in reversed(self._undo):
      setattr(owner, name, orig)
    self._undo.clear()


def profile_loop(k: int, steps: int, repeats: int, prefetch: int = 0,
                 source: str = "list") -> dict:
  """Best-of-``repeats`` per-phase microseconds per call of one ``TrainLoop.run``.

  ``source``: ``"list"``, an iterator over a list of numpy batches (a Python object per
  batch, as from most input pipelines), or ``"array"``, ``loopkit.ArraySource`` over the
  same batches in order (``shuffle=False``), which the feeder reads a chunk at a time
  (``chunk_at``).
  """
  w = wl.get("mlp", steps)
  data = wl.make_data(w)
  batches = wl.batch_list(data)
  if source == "array":
    def make_source(n):
      return wl.array_source({name: v[:n] for name, v in data.items()})
  else:
    def make_source(n):
      return iter(batches[:n])
  loop = loopkit.TrainLoop(wl.make_train_step(w), iterations_per_loop=k, mesh=sy.data_mesh(),
                           prefetch=prefetch)
  jax.block_until_ready(loop.run(wl.init_state(w), make_source(k + max(1, k // 2)),
                                 num_steps=k + max(1, k // 2)))
  calls = -(-steps // k)
  best = None
  for _ in range(repeats):
    ph = Phases()
    per_timer = ph.overhead()
    ph.install()
    try:
      state = wl.init_state(w)
      before = loop.ledger  # replaced by a new ledger when the run starts from step 0
      waited = before.seconds.get("device_wait", 0.0) if before is not None else 0.0
      c0, m0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
      state = loop.run(state, make_source(steps), num_steps=steps)
      jax.block_until_ready(state)
      wall, cpu = time.perf_counter() - t0, time.process_time() - c0
      main_cpu = time.thread_time() - m0
    finally:
      ph.uninstall()
    row = {p: ph.secs[p] / calls * 1e6 for p in PHASES if p != "loop"}
    timers = per_timer * ph.calls["main"] / calls * 1e6
    row["loop"] = main_cpu / calls * 1e6 - sum(row.values()) - timers
    row["main"] = main_cpu / calls * 1e6 - timers
    row["timers"] = timers
    # The loop's own wall-clock bucket for the fetch (includes waiting for the device).
    row["wait"] = (loop.ledger.seconds["device_wait"]
                   - (waited if loop.ledger is before else 0.0)) / calls * 1e6
    row["producer"] = max(0.0, (sum(ph.producer.values())
                                - per_timer * ph.calls["producer"]) / calls * 1e6)
    row["wall"] = wall / calls * 1e6
    row["cpu"] = cpu / calls * 1e6
    row["steps_per_s"] = steps / wall
    if best is None or row["main"] + row["producer"] < best["main"] + best["producer"]:
      best = row
  assert loop.program.compile_count() == 1, loop.program.compile_count()
  return best


def profile_bare_jit(steps: int, repeats: int) -> dict:
  """The per-step jit loop, numpy batches in (systems.PerStepJit without prefetch)."""
  w = wl.get("mlp", steps)
  s = sy.PerStepJit(w, wl.make_data(w), prefetch=False)
  s.warm()
  best = None
  for _ in range(repeats):
    c0 = time.process_time()
    wall = s.timed()
    row = {"wall": wall / steps * 1e6, "cpu": (time.process_time() - c0) / steps * 1e6,
           "steps_per_s": steps / wall}
    if best is None or row["wall"] < best["wall"]:
      best = row
  return best


def profile_program(k: int, calls: int, repeats: int) -> dict:
  """loopkit's program alone, back to back on one placed chunk (two calls in flight).

  The chunk is the one a run feeds: ``[max(K, 2), B, ...]`` (K = 1: a zero second slot).
  """
  w = wl.get("mlp", calls * k)
  data = wl.make_data(w, k)
  data = wl.pad_slots(data, program_lib.MIN_SLOTS)  # as loopkit/feeding.py forms it
  program = loopkit.core.MultiStepProgram(wl.make_train_step(w), iterations_per_loop=k,
                                     mesh=sy.data_mesh())
  chunk = jax.device_put(data, program.batch_sharding)
  n = jax.device_put(np.int32(k), program.replicated)
  best = None
  for _ in range(repeats + 1):
    state = program.place_state(wl.init_state(w))
    prev = None
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
      state, out = program(state, chunk, n)
      if prev is not None:
        np.asarray(prev.step)
      prev = out
    jax.block_until_ready(state)
    wall = time.perf_counter() - t0
    row = {"wall": wall / calls * 1e6, "cpu": (time.process_time() - c0) / calls * 1e6,
           "steps_per_s": calls * k / wall}
    if best is None or row["wall"] < best["wall"]:
      best = row
  return best


def render(rows: list[tuple[str, dict]]) -> str:
  head = ("| run | " + " | ".join(PHASES) + " | timers | main CPU | prefetch CPU | host CPU "
          "(main + prefetch) | process CPU | wait | wall | steps/s |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for name, r in rows:
    cells = [f"{r[p]:.1f}" if p in r else "" for p in PHASES + ("timers",)]
    cells += [f"{r[c]:.1f}" if r.get(c) else "" for c in ("main", "producer")]
    cells.append(f"{r['main'] + r['producer']:.1f}" if "main" in r else "")
    cells += [f"{r['cpu']:.1f}", f"{r['wait']:.1f}" if "wait" in r else "", f"{r['wall']:.1f}",
              f"{r['steps_per_s']:,.0f}"]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def memcpy_gb_s(nbytes: int = 832_000, repeats: int = 200) -> float:
  """Host memcpy speed, GB/s: ``np.copyto`` of ``nbytes`` (a K = 100 MLP chunk), best of
  ``repeats`` after a warm-up copy."""
  src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
  np.copyto(dst, src)
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    best = min(best, time.perf_counter() - t0)
  return nbytes / best / 1e9


def profile_rows(repeats: int, ks=(1, 100), prefetches=(0, 2), steps: int | None = None,
                 sources=("list", "array")) -> list[tuple[str, dict]]:
  """Every row of the profile table at this process's device count (see module docstring)."""
  steps = steps or (2000 if jax.device_count() == 1 else 400)
  step_bytes = wl.BATCH * (64 * 4 + 4)  # the MLP batch: x float32 [B, 64], y int32 [B]
  rows = []
  for k in ks:
    s = max(steps, 2 * k) if k == 1 else max(steps * 5, 2 * k)
    for source in sources:
      for pf in prefetches:
        row = profile_loop(k, s, repeats, pf, source)
        row["chunk_bytes"] = k * step_bytes
        rows.append((f"loopkit K={k} prefetch={pf}" + (" ArraySource" if source == "array"
                                                        else ""), row))
    rows.append((f"program only K={k}", profile_program(k, max(10, s // k), repeats)))
  rows.append(("bare jit (per step)", profile_bare_jit(steps, repeats)))
  return rows


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--devices", type=int, default=1)
  p.add_argument("--ks", type=int, nargs="+", default=[1, 100])
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--steps", type=int, help="steps per run at K = 1 (default 2000 on 1 device, "
                 "400 on 8; 5x that at larger K)")
  p.add_argument("--prefetch", type=int, nargs="+", default=[0, 2])
  p.add_argument("--sources", nargs="+", default=["list", "array"], choices=["list", "array"],
                 help="list: an iterator of numpy batches; array: loopkit.ArraySource")
  args = p.parse_args()
  with open("/proc/loadavg") as f:
    load0 = " ".join(f.read().split()[:3])
  rows = profile_rows(args.repeats, args.ks, args.prefetch, args.steps, args.sources)
  with open("/proc/loadavg") as f:
    load1 = " ".join(f.read().split()[:3])
  print(f"{jax.device_count()} device(s), jax {jax.__version__}, load average {load0} -> "
        f"{load1}; us per device call, best of {args.repeats} runs by host CPU; memcpy "
        f"{memcpy_gb_s():.1f} GB/s")
  print(render(rows))


if __name__ == "__main__":
  main()
