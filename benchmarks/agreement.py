"""The boundary agreement on several processes: its cost, and the device time it leaves idle.

Usage (from the repository root)::

  python benchmarks/agreement.py [--calls 40] [--step_ms 20]

Starts 2 processes x 1 CPU device under ``jax.distributed`` (``loopkit.tools.testing``) and
measures, side by side in one run, the agreement through the coordination service (loopkit's
default) and through a device all-gather (the fallback, forced by hiding the service's client):

* the cost of one agreement with nothing in flight (median of 200);
* the cost of one agreement while a program of about 0.5 s runs on the device;
* a ``TrainLoop`` whose step takes about ``--step_ms`` on the device, at K = 1 and K = 10:
  wall seconds per call and the device's idle time per call (wall minus the device time of
  the same call run alone, back to back).

Prints one markdown table; every figure is process 0's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hidden_client():
  """A context in which loopkit sees no coordination client (the device fallback)."""
  import contextlib  # pylint: disable=g-import-not-at-top

  from loopkit._internal import compat  # pylint: disable=g-import-not-at-top

  @contextlib.contextmanager
  def hidden():
    saved = compat.coordination_client
    compat.coordination_client = lambda: None
    try:
      yield
    finally:
      compat.coordination_client = saved
  return hidden()


def _matmul_chain(size: int, seconds: float):
  """``(f, w, x, n)``: ``f(x, n)`` runs n ``tanh(y @ w)`` steps on ``[size, size]`` float32,
  with n sized (after a warm-up) to take about ``seconds`` on this CPU device."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  w = jnp.full((size, size), 1e-3, jnp.float32)
  f = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ w), x))
  x = jnp.ones((size, size), jnp.float32)
  f(x, 2).block_until_ready()
  t0 = time.perf_counter()
  f(x, 20).block_until_ready()
  return f, w, x, max(1, int(20 * seconds / (time.perf_counter() - t0)))


def _step_fn(step_ms: float):
  """A train step of about ``step_ms`` on this CPU device (a chain of small matmuls)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  _, w, _, n = _matmul_chain(256, step_ms / 1e3)

  def train_step(state, batch):
    y = jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ w), state["y"] + jnp.mean(batch["x"]))
    return {"y": y, "step": state["step"] + 1}, {"v": jnp.mean(y)}
  return train_step


def worker(calls: int, step_ms: float) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import loopkit  # pylint: disable=g-import-not-at-top
  from loopkit.core import agreement  # pylint: disable=g-import-not-at-top

  def cost(n: int = 200) -> float:
    agreement.agree([False])
    times = []
    for _ in range(n):
      t0 = time.perf_counter()
      agreement.agree([False, False])
      times.append(time.perf_counter() - t0)
    return statistics.median(times)

  def in_flight() -> float:
    f, _, x, n = _matmul_chain(512, 0.5)
    agreement.agree([False])
    out = f(x, n)
    t0 = time.perf_counter()
    agreement.agree([False])
    secs = time.perf_counter() - t0
    out.block_until_ready()
    return secs

  step = _step_fn(step_ms)
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  data = {"x": np.zeros((calls * 10 * jax.device_count(), 1), np.float32)}

  def init() -> dict:  # a new state per run (a run donates its state)
    return {"y": jnp.zeros((256, 256), jnp.float32), "step": jnp.zeros((), jnp.int32)}

  def loop_run(k: int) -> float:
    loop = loopkit.TrainLoop(step, iterations_per_loop=k, mesh=mesh)
    source = loopkit.ArraySource(data, global_batch_size=jax.device_count(), shuffle=False)
    loop.run(init(), source, num_steps=k * 2)  # compile and warm
    t0 = time.perf_counter()
    loop.run(init(), source, num_steps=k * calls)
    return (time.perf_counter() - t0) / calls

  out = {}
  for path in ("service", "devices"):
    ctx = _hidden_client() if path == "devices" else _null()
    with ctx:
      out[f"{path}/cost"] = cost()
      out[f"{path}/in_flight"] = in_flight()
      for k in (1, 10):
        out[f"{path}/wall_k{k}"] = loop_run(k)
  # the device time of one call of k steps, alone: the step's time x k, measured back to back
  state = init()
  batch = {"x": jnp.zeros((1, 1), jnp.float32)}
  f = jax.jit(step)
  f(state, batch)[0]["y"].block_until_ready()
  t0 = time.perf_counter()
  s = state
  for _ in range(20):
    s = f(s, batch)[0]
  s["y"].block_until_ready()
  out["device_step"] = (time.perf_counter() - t0) / 20
  return out


def _null():
  import contextlib  # pylint: disable=g-import-not-at-top
  return contextlib.nullcontext()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--calls", type=int, default=40)
  parser.add_argument("--step_ms", type=float, default=20.0)
  args = parser.parse_args()
  from loopkit.tools import testing  # pylint: disable=g-import-not-at-top
  load0 = os.getloadavg()[0]
  results = testing.run_processes(worker, num_processes=2, devices_per_process=1,
                                  args=(args.calls, args.step_ms), timeout_s=1200)
  r = results[0]
  step = r["device_step"]
  print(f"2 processes x 1 CPU device, {os.cpu_count()} cores, load {load0:.1f} -> "
        f"{os.getloadavg()[0]:.1f}; device time of one step alone {step * 1e3:.1f} ms\n")
  print("| agreement through | one agreement | with a 0.5 s program in flight | "
        "K=1 wall/call | K=1 idle/call | K=10 wall/call | K=10 idle/call |")
  print("|---|---|---|---|---|---|---|")
  for path in ("service", "devices"):
    cells = [f"{r[f'{path}/cost'] * 1e3:.2f} ms", f"{r[f'{path}/in_flight'] * 1e3:.1f} ms"]
    for k in (1, 10):
      wall = r[f"{path}/wall_k{k}"]
      cells += [f"{wall * 1e3:.1f} ms", f"{max(wall - k * step, 0) * 1e3:.1f} ms"]
    name = "coordination service" if path == "service" else "device all-gather"
    print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
