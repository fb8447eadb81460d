"""Process measurements around the benchmarked systems: memory, compilations, and the cost of
loopkit's tail/event mechanism.

* RSS now and at its peak (``/proc/self/status``), and :func:`rss_growth` over a run's calls;
* :class:`CompileCounter`: XLA backend compilations in this process;
* :func:`mechanism_cost`: loopkit's program (``fori_loop``, traced trip count) against an
  unmasked ``lax.scan`` of K steps on a chunk already on the device.

Runs in a worker process whose device count was fixed before JAX started.
"""

from __future__ import annotations

import gc
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import loopkit
from benchmarks import workloads as wl
from benchmarks.systems import System, data_mesh

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


# -- process measurements -----------------------------------------------------

def _status_kb(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise RuntimeError(f"{field} not in /proc/self/status")


def rss_mb() -> float:
  """Resident set size of this process now, MiB (``VmRSS``)."""
  return _status_kb("VmRSS") / 1024


def peak_rss_mb() -> float:
  """Peak resident set size since the last :func:`reset_peak_rss`, MiB (``VmHWM``)."""
  return _status_kb("VmHWM") / 1024


def reset_peak_rss() -> bool:
  """Resets ``VmHWM`` to the current RSS (Linux ``clear_refs`` 5); False if not allowed."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


class CompileCounter:
  """Counts XLA backend compilations (``jax.monitoring`` duration events) in this process."""

  def __init__(self):
    self.count = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration_secs: float, **kwargs) -> None:
    del duration_secs, kwargs
    if event == BACKEND_COMPILE_EVENT:
      self.count += 1


# -- the tail/event mechanism ----------------------------------------------------

def mechanism_cost(w: wl.Workload, data: dict[str, np.ndarray], k: int, calls: int,
                   repeats: int) -> dict[str, float]:
  """Device time per call of loopkit's program against an unmasked ``lax.scan`` of K steps.

  Both run on the same device-resident chunk ``[K, B, ...]`` (no host feeding),
  ``calls`` calls back to back (the output of call i - 1 waited for after call i
  is dispatched, as loopkit does: two calls in flight at most), best of
  ``repeats``; both return the state and
  the ``[K]`` loss trace. loopkit's program (``fori_loop`` with a traced trip
  count, the metric reduction over the first n slots) is timed at n = K and at
  n = K // 2 (a tail call: half the steps, the same chunk).

  Returns:
    ``{"scan_us": ..., "loopkit_us": ..., "loopkit_half_us": ...}``, microseconds
    per call.
  """
  mesh = data_mesh()
  replicated = NamedSharding(mesh, P())
  chunk = jax.device_put({k_: v[:k] for k_, v in data.items()},
                         NamedSharding(mesh, P(None, "data")))
  step = wl.make_train_step(w)
  program = loopkit.core.MultiStepProgram(step, iterations_per_loop=k, mesh=mesh)

  def scan_k(state, batches):
    state, m = jax.lax.scan(step, state, batches)
    return state, (m, m["loss"].mean(), state["step"])

  scan = jax.jit(scan_k, donate_argnums=(0,))
  n_full = jax.device_put(np.int32(k), replicated)
  n_half = jax.device_put(np.int32(max(1, k // 2)), replicated)

  def once(fn) -> float:
    state = jax.block_until_ready(jax.device_put(wl.init_state(w), replicated))
    t0 = time.perf_counter()
    prev = None
    for _ in range(calls):
      state, out = fn(state)
      jax.block_until_ready(prev)
      prev = out
    jax.block_until_ready((state, out))
    return (time.perf_counter() - t0) / calls * 1e6

  program.place_state(wl.init_state(w))
  fns = {"scan_us": lambda s: scan(s, chunk),
         "loopkit_us": lambda s: program(s, chunk, n_full),
         "loopkit_half_us": lambda s: program(s, chunk, n_half)}
  for fn in fns.values():
    once(fn)  # compile and warm
  results = {name: float("inf") for name in fns}
  for _ in range(repeats):  # interleaved, best of `repeats`
    for name, fn in fns.items():
      results[name] = min(results[name], once(fn))
  results["loopkit_compiles"] = program.compile_count()
  return results


def rss_growth(system: System, calls: int, warm_calls: int = 20) -> float:
  """RSS growth in MiB over ``calls`` device calls within one run.

  One run of ``warm_calls + calls`` calls on cycled data (the source holds no new
  memory); RSS is read after call ``warm_calls`` and after the run, each time
  after ``gc.collect()``.
  """
  marks = []

  def mark():
    gc.collect()
    marks.append(rss_mb())

  system.run_calls(warm_calls + calls, warm_calls, mark)
  gc.collect()
  if len(marks) == 2:  # the system took its own end reading (Keras: on_train_end)
    return marks[1] - marks[0]
  if len(marks) != 1:
    raise RuntimeError(f"{system.name}: the RSS mark fired {len(marks)} times, expected once")
  return rss_mb() - marks[0]
