"""What does compiling K = 1 for two chunk slots cost (loopkit/program.py, case C38)?

At K = 1 the program pads the chunk ``[1, B, ...]`` with one zero slot on the
device (a copy of one batch per call) and keeps a 2-slot metric trace, so the
loop body compiles exactly as at K = 2. This script times K = 1 calls of
:class:`loopkit.MultiStepProgram` with ``MIN_SLOTS = 2`` (the shipped program)
and ``MIN_SLOTS = 1`` (the old one, no padding), interleaved over ``--repeats``
rounds, best round kept, on the ``mlp`` (dispatch-bound) and ``cnn``
(compute-bound) workloads of ``benchmarks/workloads.py``, global style, all
devices. Chunks are placed before timing, so the time is dispatch + device.
K >= 2 is unchanged by construction (``max(K, 2) == K``).

Usage (from the repository root)::

  python -m benchmarks.k1_slot_cost --repeats 5
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import loopkit
from benchmarks import workloads
from loopkit import program as program_lib


def time_k1(name: str, min_slots: int, num_steps: int) -> float:
  """Steps per second of ``num_steps`` K = 1 calls (after one compiling call)."""
  program_lib.MIN_SLOTS = min_slots
  w = workloads.get(name, num_steps)
  program = loopkit.MultiStepProgram(workloads.make_train_step(w), iterations_per_loop=1,
                                     mesh=loopkit.data_parallel_mesh())
  state = program.place_state(workloads.init_state(w))
  data = workloads.make_data(w, num_steps)
  chunks = [jax.device_put({"x": data["x"][i:i + 1], "y": data["y"][i:i + 1]},
                           program.batch_sharding) for i in range(num_steps)]
  one = jax.device_put(np.int32(1), program.replicated)
  state, _ = program(state, chunks[0], one)
  jax.block_until_ready(state)
  t0 = time.perf_counter()
  for c in chunks:
    state, out = program(state, c, one)
  jax.block_until_ready((state, out))
  return num_steps / (time.perf_counter() - t0)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--mlp-steps", type=int, default=2000)
  parser.add_argument("--cnn-steps", type=int, default=200)
  args = parser.parse_args()
  for name, steps in (("mlp", args.mlp_steps), ("cnn", args.cnn_steps)):
    best = {1: 0.0, 2: 0.0}
    for _ in range(args.repeats):
      for slots in (1, 2):
        best[slots] = max(best[slots], time_k1(name, slots, steps))
    print(f"{name} K=1: {best[1]:.0f} steps/s unpadded (MIN_SLOTS=1), {best[2]:.0f} steps/s "
          f"padded (MIN_SLOTS=2), ratio {best[2] / best[1]:.3f}", flush=True)


if __name__ == "__main__":
  main()
