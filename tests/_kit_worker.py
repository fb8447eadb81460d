"""Run by every process of tests/test_plateau.py's two-process test (the trainer kit's decisions
on several processes): a ``max_time`` spent on one process only, and an early stop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import loopkit
from loopkit.core.time_limit import TimeLimit
from loopkit.data import sources
from tests import toy
from tests.multihost_workers import GLOBAL_BATCH, dataset

EVERY = 4
# Evaluations at steps 4, 8, 12, ...: 5.0 (best), 4.0 (best), 4.5, 3.9, 4.2, 4.1, 3.0, ...
# min_delta=0.2: 3.9 does not beat 4.0 by 0.2, so steps 12, 16, 20 do not improve.
TABLE = np.array([9.0, 5.0, 4.0, 4.5, 3.9, 4.2, 4.1, 3.0, 2.0, 1.0, 0.5, 0.4, 0.3], np.float32)


def table_eval(state, batch):
  """A per-example metric read from :data:`TABLE` at the state's step // EVERY."""
  value = jnp.asarray(TABLE)[state["step"] // EVERY]
  return {"score": jnp.broadcast_to(value, batch["x"].shape[:1])}


class CountingClock:
  """Each read is one second later than the last: the run reads it once at its start and once
  per boundary, so the budget runs out at a known boundary."""

  def __init__(self):
    self.reads = 0

  def __call__(self):
    self.reads += 1
    return float(self.reads - 1)


def kit_decisions() -> dict:
  """``(status, ledger step)`` of a run whose budget runs out on the last process only, and of
  an early-stopped run, on this process."""
  out = {}
  last = jax.process_index() == jax.process_count() - 1
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2)
  loop.run(toy.init_state(), sources.ArraySource(dataset(), GLOBAL_BATCH), num_steps=20,
           max_time=TimeLimit(3.5, clock=CountingClock()) if last else None)
  out["time_limit"] = (loop.status, loop.ledger.step)
  local = 8 // jax.process_count()
  evals = loopkit.EvalHook(loopkit.Evaluator(table_eval, global_batch_size=8),
                           [{"x": np.zeros((local, 4), np.float32)}], num_batches=1,
                           every_steps=EVERY)
  stop = loopkit.training.EarlyStopping(evals, "score", patience=3, min_delta=0.2)
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=[evals, stop])
  loop.run(toy.init_state(), sources.ArraySource(dataset(), GLOBAL_BATCH), num_steps=40)
  out["early_stop"] = (loop.status, loop.ledger.step, stop.best_step)
  return out
