"""Subprocess worker for C69: a checkpointed run over a GrainSource with one worker process.

Run as ``python tests/_grain_kill_worker.py --dir D``. Trains the toy model on 1 CPU device
(K=2, a checkpoint every 2 steps, a GrainSource with ``worker_count=1``), prints ``SAVED
<step>`` once the first checkpoint started (the Grain worker and multiprocessing's resource
tracker are running then), then keeps training slowly (0.2 s per boundary) until the parent
kills it; on SIGTERM the checkpoint hook saves and the run ends with ``DONE <status> <step>``.

Used by tests/test_grain_source.py::test_c69_nothing_outlives_a_killed_run; not a test module.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __name__ == "__main__":  # the device count before JAX is imported; Grain's spawned
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from tests import bootstrap  # worker re-imports this file as __mp_main__ and skips it

  bootstrap.start(1)

  import loopkit
  from loopkit.data import GrainSource
  from tests import toy

  class Announce(loopkit.Hook):
    """After the checkpoint hook's first save: prints SAVED, then slows each boundary."""

    needs_state = False

    def __init__(self):
      super().__init__(every_steps=2)
      self.saved = False

    def on_trigger(self, info, state):
      if not self.saved:
        self.saved = True
        print(f"SAVED {info.end_step}", flush=True)
      else:
        time.sleep(0.2)

  p = argparse.ArgumentParser()
  p.add_argument("--dir", required=True)
  args = p.parse_args()
  batches = toy.batches(4, batch_size=16)
  records = [{"x": x, "y": y} for b in batches for x, y in zip(b["x"], b["y"], strict=True)]
  src = GrainSource(records, 8, seed=0, worker_count=1)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2,
                           hooks=[loopkit.CheckpointHook(args.dir, every_steps=2), Announce()])
  loop.run(toy.init_state(), src, num_steps=100_000)
  print(f"DONE {loop.status} {loop.ledger.step}", flush=True)
