"""Subprocess worker for the NNX kill-and-resume test (tests/test_nnx.py).

``python tests/_nnx_worker.py --out O [--dir D] [--kill-at S]``: trains the NNX CNN of
tests/nnx_models.py (Flax MNIST's step, Dropout + BatchNorm + nnx.Rngs) to ``--num-steps``
through :class:`loopkit.nnx.NnxTrainLoop`, with a :class:`loopkit.CheckpointHook` in ``--dir``
when given (restoring the latest checkpoint first). ``--kill-at S`` SIGKILLs the process right
after the checkpoint of step S is written. Writes ``O.npz`` (every array of the user's objects,
typed keys as key data) and ``O.json`` (status, restored step, ledger step) when it returns.
Not a test module itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

if __name__ == "__main__":  # set the device count before JAX is imported
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--dir", default=None)
  p.add_argument("--devices", type=int, default=1)
  p.add_argument("--k", type=int, default=3)
  p.add_argument("--num-steps", type=int, default=12)
  p.add_argument("--every-steps", type=int, default=3)
  p.add_argument("--kill-at", type=int, default=-1)
  ARGS = p.parse_args()
  here = os.path.dirname(os.path.abspath(__file__))
  sys.path[:0] = [os.path.dirname(here), here]
  from tests import bootstrap
  bootstrap.start(ARGS.devices)  # CPU, ARGS.devices fake devices

import jax  # noqa: E402
import nnx_models  # noqa: E402
import numpy as np  # noqa: E402

import loopkit  # noqa: E402
import loopkit.nnx  # noqa: E402


def main(args) -> None:
  model, optimizer, metrics, rngs = nnx_models.make()
  hooks = []
  ckpt = None
  if args.dir:
    ckpt = loopkit.CheckpointHook(args.dir, every_steps=args.every_steps)
    hooks.append(ckpt)
    if args.kill_at > 0:
      def kill(info, state):
        ckpt.wait_until_finished()
        os.kill(os.getpid(), signal.SIGKILL)
      hooks.append(loopkit.CallbackHook(kill, needs_state=False, at_steps=[args.kill_at]))
  loop = loopkit.nnx.NnxTrainLoop(
      nnx_models.train_step, model, optimizer, metrics, extra=(rngs,),
      iterations_per_loop=args.k, hooks=hooks,
      mesh=loopkit.data_parallel_mesh(devices=jax.devices()[:args.devices]))
  loop.run(nnx_models.batches(args.num_steps), num_steps=args.num_steps)
  np.savez(args.out + ".npz", *nnx_models.arrays((model, optimizer, metrics, rngs)))
  with open(args.out + ".json", "w") as f:
    json.dump({"status": loop.status, "step": loop.ledger.step,
               "optimizer_step": int(optimizer.step[...]),
               "restored_step": None if ckpt is None else ckpt.restored_step}, f)


if __name__ == "__main__":
  main(ARGS)
