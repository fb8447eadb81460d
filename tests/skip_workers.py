"""Worker for tests/test_skips.py's two-process test (run by loopkit.tools.processes)."""

from __future__ import annotations

import jax
import numpy as np

import loopkit
from loopkit.checkpoint import CheckpointHook, LossSpikeHook
from tests import toy

TRUE_W = np.random.default_rng(1).normal(size=(4, 2)).astype(np.float32)


class ProcessRows:
  """The step-indexed source of tests/test_skips.py, this process's half of each batch of 16,
  the batch of data step 37 scaled by 100."""

  def batch_at(self, i):
    x = np.random.default_rng([7, i]).normal(size=(16, 4)).astype(np.float32)
    if i + 1 == 37:
      x = x * 100
    rows = slice(8 * jax.process_index(), 8 * (jax.process_index() + 1))
    return {"x": x[rows], "y": (x @ TRUE_W)[rows]}


class SeenOnProcessOne(LossSpikeHook):
  """A host-local rule: only process 1 asks for the rewind; the agreement must carry it."""

  def rewind_request(self, info):
    request = super().rewind_request(info)
    return request if jax.process_index() == 1 else None


def rewind_agreed(directory_a: str, directory_b: str) -> dict:
  """Run A (the spike seen by process 1 only) and run B (skip_steps=[(31, 40)]), K=4, 50 steps."""
  out = {}
  for name, directory in (("a", directory_a), ("b", directory_b)):
    hooks: list = []
    if name == "a":  # (run B needs no checkpoints)
      ckpt = CheckpointHook(directory, every_steps=10)
      watch = SeenOnProcessOne(ckpt, factor=10, window=5, margin=3)
      hooks = [ckpt, watch]
    loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=4, hooks=hooks)
    state = loop.run(toy.init_state(), ProcessRows(), num_steps=50,
                     skip_steps=None if name == "a" else [(31, 40)])
    ledger = loop.ledger
    out[name] = {"params": {k: np.asarray(jax.device_get(v)).tobytes()
                            for k, v in state["params"].items()},
                 "ledger": (ledger.step, ledger.skipped_steps, ledger.skip_steps,
                            ledger.loop_index, ledger.lost_steps)}
    if name == "a":
      out[name].update(restored=[r["restored_step"] for r in watch.rewinds],
                       saved=ckpt.all_steps())
  return out
