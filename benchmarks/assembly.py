"""Where to form a chunk and which loop runs a full call, on this machine's CPU devices.

``TrainLoop(chunk_assembly="host" | "device", full_call_loop="traced" | "static")`` for the
``mlp`` (dispatch-bound) and ``cnn`` (compute-bound) workloads of ``benchmarks/workloads.py``,
end to end from a host list of batches (the path of a plain iterator), at K = 10 and 100 on all
local devices. Settings are interleaved over ``--repeats`` rounds and each keeps its median
steps/s; the ratios are to the CPU default (``host``, ``traced``) measured in the same round.
``"auto"`` picks ``host`` and ``traced`` on CPU meshes: this prints why.

Usage (from the repository root)::

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.assembly --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

import loopkit
from benchmarks import workloads

SETTINGS = (("host", "traced"), ("device", "traced"), ("host", "static"), ("device", "static"))


def steps_per_sec(name: str, k: int, assembly: str, full: str, num_steps: int) -> float:
  """Steady steps/s of one ``TrainLoop`` run (a warm-up run of 2 calls compiles first)."""
  w = workloads.get(name, num_steps)
  batches = workloads.batch_list(workloads.make_data(w, num_steps + 2 * k))
  loop = loopkit.TrainLoop(workloads.make_train_step(w), iterations_per_loop=k,
                           chunk_assembly=assembly, full_call_loop=full)
  state = jax.block_until_ready(loop.run(workloads.init_state(w), batches[:2 * k],
                                         num_steps=2 * k))
  t0 = time.perf_counter()
  state = jax.block_until_ready(loop.run(state, batches[2 * k:], num_steps=2 * k + num_steps))
  return num_steps / (time.perf_counter() - t0)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--steps", type=int, default=400, help="timed steps per run")
  args = parser.parse_args()
  print(f"{jax.device_count()} {jax.devices()[0].platform} devices, jax {jax.__version__}, "
        f"{args.steps} timed steps, median of {args.repeats} interleaved rounds")
  print("| workload | K | assembly | full calls | steps/s | / host+traced |")
  print("|---|---:|---|---|---:|---:|")
  for name in ("mlp", "cnn"):
    for k in (10, 100):
      rates: dict[tuple[str, str], list[float]] = {s: [] for s in SETTINGS}
      ratios: dict[tuple[str, str], list[float]] = {s: [] for s in SETTINGS}
      for _ in range(args.repeats):
        round_rates = {s: steps_per_sec(name, k, *s, args.steps) for s in SETTINGS}
        for s in SETTINGS:
          rates[s].append(round_rates[s])
          ratios[s].append(round_rates[s] / round_rates[SETTINGS[0]])
      for s in SETTINGS:
        print(f"| {name} | {k} | {s[0]} | {s[1]} | {statistics.median(rates[s]):,.0f} | "
              f"{statistics.median(ratios[s]):.2f} |")


if __name__ == "__main__":
  main()
