"""Subprocess worker for tests/test_resume_rows.py: a logged, checkpointed run cut one way.

Run as ``python tests/bootstrap.py --devices 1 tests/_rows_worker.py --dir D --cut C --at S``.
22 steps per epoch (an :class:`loopkit.ArraySource` of 176 examples, batch 8), K=7, 44 steps;
hooks, in this order: a :class:`loopkit.LoggingHook` every epoch (``D/epoch.jsonl``), one every
9 steps (``D/steps.jsonl``), an :class:`loopkit.EvalHook` every 9 steps (``D/eval.jsonl``), a
:class:`loopkit.CheckpointHook` every 14 steps (``D/ckpt``) and, unless ``--cut none``, a hook
that cuts the run at its boundary of step ``S``:

* ``sigint`` / ``sigterm``: sends that signal to this process (the run stops there,
  "preempted", and saves);
* ``kill``: ``SIGKILL`` to this process;
* ``raise``: raises ``RuntimeError`` (the process exits 1);
* ``raise-rerun``: raises once, then the script runs the same loop again (as in a notebook).

Prints ``STATUS <status> <step>`` when a run returns. Rows are compared by the test.
"""

from __future__ import annotations

import argparse
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax

import loopkit
from loopkit.checkpoint import CheckpointHook
from loopkit.observe.writers import JsonlWriter

K, SPE, BATCH, NUM_STEPS = 7, 22, 8, 44
TX = optax.adam(0.05)


def parse_args():
  p = argparse.ArgumentParser()
  p.add_argument("--dir", required=True)
  p.add_argument("--cut", default="none",
                 choices=["none", "sigint", "sigterm", "kill", "raise", "raise-rerun"])
  p.add_argument("--at", type=int, default=7)
  return p.parse_args()


def data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(SPE * BATCH, 4)).astype(np.float32)
  w = rng.normal(size=(4, 3)).astype(np.float32)
  y = np.argmax(x @ w + rng.normal(size=(SPE * BATCH, 3)).astype(np.float32), axis=1)
  return {"x": x, "y": y.astype(np.int32)}


def init_state():
  params = {"w": jax.random.normal(jax.random.key(0), (4, 3)) * 0.1, "b": jnp.zeros((3,))}
  return {"params": params, "opt": TX.init(params), "step": jnp.zeros((), jnp.int32)}


def logits_of(params, batch):
  return batch["x"] @ params["w"] + params["b"]


def train_step(state, batch):
  def loss_fn(params):
    logits = logits_of(params, batch)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits
  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
  updates, opt = TX.update(grads, state["opt"], state["params"])
  accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
  return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
           "step": state["step"] + 1}, {"loss": loss, "accuracy": accuracy})


def eval_step(state, batch):
  logits = logits_of(state["params"], batch)
  return {"accuracy": (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)}


class Cut(loopkit.Hook):
  """Cuts the run at its boundary of step ``at`` (see the module docstring)."""

  def __init__(self, how: str, at: int):
    super().__init__(at_steps=[at], at_end=False)
    self.how, self.armed = how, True

  def on_trigger(self, info, state):
    if not self.armed:
      return None
    self.armed = False
    if self.how in ("sigint", "sigterm"):
      os.kill(os.getpid(), signal.SIGINT if self.how == "sigint" else signal.SIGTERM)
    elif self.how == "kill":
      os.kill(os.getpid(), signal.SIGKILL)
    else:
      raise RuntimeError(f"hook failed at step {info.end_step}")
    return None


def main():
  args = parse_args()
  d = args.dir
  arrays = data()
  evaluator = loopkit.Evaluator(eval_step, global_batch_size=BATCH)
  eval_batches = [{k: v[i:i + BATCH] for k, v in arrays.items()} for i in range(0, 32, BATCH)]
  hooks = [
      loopkit.LoggingHook(JsonlWriter(os.path.join(d, "epoch.jsonl")), every_epochs=1,
                          throughput=False),
      loopkit.LoggingHook(JsonlWriter(os.path.join(d, "steps.jsonl")), every_steps=9,
                          throughput=False),
      loopkit.EvalHook(evaluator, eval_batches, writer=JsonlWriter(os.path.join(d, "eval.jsonl")),
                       every_steps=9),
      CheckpointHook(os.path.join(d, "ckpt"), every_steps=14, async_save=False),
  ]
  if args.cut != "none":
    hooks.append(Cut(args.cut.removesuffix("-rerun"), args.at))
  loop = loopkit.TrainLoop(train_step, iterations_per_loop=K, hooks=hooks, steps_per_epoch=SPE)
  source = loopkit.ArraySource(arrays, BATCH, seed=1)
  try:
    loop.run(init_state(), source, num_steps=NUM_STEPS)
  except RuntimeError:
    if args.cut != "raise-rerun":
      raise
    print("RAISED", loop.ledger.step, flush=True)
    loop.run(init_state(), source, num_steps=NUM_STEPS)
  for h in hooks[:3]:
    h.writer.close()
  print("STATUS", loop.status, loop.ledger.step, flush=True)


if __name__ == "__main__":
  main()
