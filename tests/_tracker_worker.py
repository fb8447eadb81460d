"""Subprocess worker for tests/test_tracker_writers.py: a checkpointed run logging to MLflow and
W&B (offline), cut by a kill.

Run as ``python tests/bootstrap.py --devices 1 tests/_tracker_worker.py --dir D [--kill-at S]``.
toy's model, K=2, 20 steps; a :class:`loopkit.LoggingHook` every 2 steps and an
:class:`loopkit.EvalHook` every 4 steps write to ``D/metrics.jsonl``, an
:class:`~loopkit.observe.MlflowWriter` (file store ``D/mlruns``, id file in ``D``) and a
:class:`~loopkit.observe.WandbWriter` (offline, ``dir=D``), in one
:class:`~loopkit.observe.MultiWriter`; a :class:`loopkit.CheckpointHook` every 6 steps
(``D/ckpt``); with ``--kill-at S``, a hook that sends ``SIGKILL`` to this process at its
boundary of step ``S``. The environment is the parent's (``WANDB_SERVICE`` included).

Prints ``RUN <mlflow run id> <wandb run id>`` once the writers are made and ``STATUS <status>
<step>`` when the run returns.
"""

from __future__ import annotations

import argparse
import os
import signal

import loopkit
from loopkit.checkpoint import CheckpointHook
from loopkit.observe import JsonlWriter, MlflowWriter, MultiWriter, WandbWriter
from tests import toy

NUM_STEPS = 20


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--dir", required=True)
  p.add_argument("--kill-at", type=int, default=None)
  args = p.parse_args()
  d = args.dir
  os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
  import wandb  # pylint: disable=g-import-not-at-top
  writer = MultiWriter([
      JsonlWriter(os.path.join(d, "metrics.jsonl")),
      MlflowWriter(experiment="loopkit-kill", tracking_uri=f"file://{d}/mlruns", dir=d),
      WandbWriter(project="loopkit-kill", dir=d, mode="offline",
                  settings=wandb.Settings(console="off"))])
  print("RUN", writer.writers[1].run_id, writer.writers[2].run.id, flush=True)
  writer.write_hparams({"lr": 0.05, "k": 2})

  def eval_step(state, batch):
    return {"err": (batch["x"] @ state["params"]["w"] - batch["y"])[:, 0] ** 2}

  hooks = [loopkit.LoggingHook(writer, every_steps=2, throughput=False),
           loopkit.EvalHook(loopkit.Evaluator(eval_step), toy.batches(2), writer=writer,
                            every_steps=4),
           CheckpointHook(os.path.join(d, "ckpt"), every_steps=6, async_save=False)]
  if args.kill_at is not None:
    hooks.append(loopkit.CallbackHook(lambda info, s: os.kill(os.getpid(), signal.SIGKILL),
                                      at_steps=[args.kill_at], at_end=False))
  loop = loopkit.TrainLoop(toy.make_global_step(), iterations_per_loop=2, hooks=hooks)
  try:
    loop.run(toy.init_state(), toy.batches(NUM_STEPS), num_steps=NUM_STEPS)
  finally:
    writer.close()
  print("STATUS", loop.status, loop.ledger.step, flush=True)


if __name__ == "__main__":
  main()
