"""The training run and the sidecar's target for tests/test_follow.py (not a test module).

Training: ``python tests/bootstrap.py --devices 2 tests/_follow_worker.py DIR [SLEEP_S]`` trains
a small linear model for :data:`NUM_STEPS` steps (K = 2) with a ``CheckpointHook`` on
``DIR/checkpoints`` (every 2 steps, ``max_to_keep=2``, so retention deletes checkpoints under a
sidecar that lags) and an ``EvalHook`` at the same steps writing ``DIR/train_eval.jsonl``;
``SLEEP_S`` seconds per batch read keep it running beside the sidecar.

Sidecar: ``python -m loopkit.tools.follow tests._follow_worker:lagging_target --directory
DIR/checkpoints --output_dir DIR/follow`` (:func:`target`: the same state structure, eval step,
eval batches and mesh; :func:`lagging_target` falls behind).
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import loopkit

NUM_STEPS, EVERY, K = 12, 2, 2
TX = optax.sgd(0.05, momentum=0.9)


def init_state():
  w = jax.random.normal(jax.random.key(0), (6, 3)) * 0.1
  return {"w": w, "opt": TX.init(w), "step": jnp.zeros((), jnp.int32)}


def train_step(state, batch):
  loss, grads = jax.value_and_grad(
      lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(state["w"])
  updates, opt = TX.update(grads, state["opt"])
  return ({"w": optax.apply_updates(state["w"], updates), "opt": opt,
           "step": state["step"] + 1}, {"loss": loss})


def eval_step(state, batch):
  err = batch["x"] @ state["w"] - batch["y"]
  return {"mse": jnp.mean(err ** 2, axis=-1), "max_err": jnp.max(jnp.abs(err), axis=-1)}


def _data(seed: int, n: int, b: int) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(seed)
  true_w = np.random.default_rng(7).normal(size=(6, 3)).astype(np.float32)
  out = []
  for _ in range(n):
    x = rng.normal(size=(b, 6)).astype(np.float32)
    out.append({"x": x, "y": (x @ true_w).astype(np.float32)})
  return out


def eval_batches() -> list[dict[str, np.ndarray]]:
  """3 batches of 8 and a short one of 5 (padded and masked by the Evaluator)."""
  return _data(1, 3, 8) + _data(2, 1, 5)


def evaluator() -> loopkit.Evaluator:
  return loopkit.Evaluator(eval_step, iterations_per_loop=2, global_batch_size=8)


def target():
  """The sidecar's ``(like, evaluator, batches)``."""
  return init_state(), evaluator(), eval_batches()


def lagging_target():
  """:func:`target` whose evaluations each wait 0.5 s first: the sidecar falls behind the
  training run, whose retention (``max_to_keep=2``) then deletes checkpoints under it."""
  batches = eval_batches()

  def slow_batches():
    time.sleep(0.5)
    return batches

  return {"like": init_state(), "evaluator": evaluator(), "batches": slow_batches}


class _Slow:
  def __init__(self, batches, sleep_s):
    self.batches, self.sleep_s = batches, sleep_s

  def __iter__(self):
    for b in self.batches:
      time.sleep(self.sleep_s)
      yield b


def train(directory: str, sleep_s: float) -> str:
  from loopkit.checkpoint import CheckpointHook  # pylint: disable=g-import-not-at-top
  from loopkit.observe.writers import JsonlWriter  # pylint: disable=g-import-not-at-top
  hooks = [CheckpointHook(f"{directory}/checkpoints", every_steps=EVERY, max_to_keep=2),
           loopkit.EvalHook(evaluator(), eval_batches(), every_steps=EVERY,
                            writer=JsonlWriter(f"{directory}/train_eval.jsonl", flush_secs=0))]
  loop = loopkit.TrainLoop(train_step, iterations_per_loop=K, hooks=hooks)
  loop.run(init_state(), _Slow(_data(0, NUM_STEPS, 8), sleep_s), num_steps=NUM_STEPS)
  hooks[1].writer.close()
  return loop.status


if __name__ == "__main__":
  print("STATUS", train(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.0),
        flush=True)
