"""What does compiling K = 1 for two chunk slots cost (loopkit/core/slot_loop.py, case C38)?

At K = 1 the loop body is compiled for two chunk slots, so it is exactly the K = 2
body. The feeder gives a K = 1 chunk its zero second slot on the host (``[2, B, ...]``,
what ``TrainLoop`` runs); a ``[1, B, ...]`` chunk given to the program directly is
padded on the device (a copy of one batch per call). This script times K = 1 calls of
:class:`loopkit.core.MultiStepProgram` three ways: ``MIN_SLOTS = 1`` (the old program, no
padding), ``MIN_SLOTS = 2`` with ``[1, B, ...]`` chunks (device padding) and with
``[2, B, ...]`` chunks (host padding, the shipped path), interleaved over ``--repeats``
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
from loopkit.core import program as program_lib, slot_loop


def time_k1(name: str, min_slots: int, num_steps: int, chunk_slots: int = 1) -> float:
  """Steps per second of ``num_steps`` K = 1 calls (after one compiling call).

  ``chunk_slots`` slots per placed chunk: 1, or 2 with a zero second slot (the feeder's).
  """
  # read by the program (its metric trace) and by the step loop (its slot padding)
  program_lib.MIN_SLOTS = slot_loop.MIN_SLOTS = min_slots
  w = workloads.get(name, num_steps)
  program = loopkit.core.MultiStepProgram(workloads.make_train_step(w), iterations_per_loop=1,
                                     mesh=loopkit.data_parallel_mesh())
  state = program.place_state(workloads.init_state(w))
  data = workloads.make_data(w, num_steps)

  chunks = [jax.device_put(workloads.pad_slots({k: v[i:i + 1] for k, v in data.items()},
                                                chunk_slots), program.batch_sharding)
            for i in range(num_steps)]
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
    ways = {"unpadded": (1, 1), "device pad": (2, 1), "host pad": (2, 2)}
    best = dict.fromkeys(ways, 0.0)
    for _ in range(args.repeats):
      for way, (min_slots, chunk_slots) in ways.items():
        best[way] = max(best[way], time_k1(name, min_slots, steps, chunk_slots))
    program_lib.MIN_SLOTS = slot_loop.MIN_SLOTS = 2
    base = best["unpadded"]
    print(f"{name} K=1 steps/s: " + ", ".join(
        f"{way} {v:.0f} ({v / base:.3f})" for way, v in best.items()), flush=True)


if __name__ == "__main__":
  main()
