"""Subprocess worker for the checkpoint tests: one training run that resumes from its directory.

Run as ``python tests/_ckpt_worker.py --dir D --out O ...``. The device count is
set (``--devices``) before JAX is imported. Prints ``READY <restored step or -1>
<sha256 of the restored state or ->`` once the run has (maybe) restored and
before training starts, then writes ``O.npz`` (final state leaves) and
``O.json`` (status, steps, saved steps) when the run returns.

Modes:
  * ``train`` (default): train with a :class:`loopkit.CheckpointHook`.
  * ``reference``: train without checkpoints; ``O.json`` also holds the
    sha256 of the state at every ``--every-steps`` boundary.
  * ``inspect``: restore ``--step`` onto ``--devices`` devices and write it.

Used by tests/test_checkpoint_process.py; not a test module itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--mode", default="train", choices=["train", "reference", "inspect"])
  p.add_argument("--dir", default=None)
  p.add_argument("--out", required=True)
  p.add_argument("--devices", type=int, default=2)
  p.add_argument("--k", type=int, default=3)
  p.add_argument("--num-steps", type=int, default=24)
  p.add_argument("--every-steps", type=int, default=2)
  p.add_argument("--max-to-keep", type=int, default=2)
  p.add_argument("--sleep-ms", type=float, default=0.0)
  p.add_argument("--sleep-at-batch", type=int, default=-1,
                 help="sleep --sleep-ms only when this batch index is read (-1: every batch)")
  p.add_argument("--prefetch", type=int, default=2)
  p.add_argument("--kill-after-save-step", type=int, default=-1,
                 help="SIGKILL this process right after the save of this step started")
  p.add_argument("--kill-at-rmdir", type=int, default=-1,
                 help="SIGKILL this process when a directory named this step is about to be "
                      "removed (its contents are gone: a retention delete cut there)")
  p.add_argument("--keep-every-steps", type=int, default=None)
  p.add_argument("--step", type=int, default=None)
  return p.parse_args(argv)


if __name__ == "__main__":  # set the device count before JAX is imported
  ARGS = parse_args()
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from tests import bootstrap
  bootstrap.start(ARGS.devices)  # CPU, ARGS.devices fake devices

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import loopkit  # noqa: E402

TX = optax.adam(0.01)
D_IN, D_OUT, BATCH = 16, 8, 8


def init_state(mesh):
  k = jax.random.key(0)
  w = jax.random.normal(k, (D_IN, D_OUT)) * 0.1
  params = {"w": w, "b": jnp.zeros((D_OUT,))}
  state = {"params": params, "opt": TX.init(params), "step": jnp.zeros((), jnp.int32)}
  # Shard every [D_IN, ...] leaf over the data axis, so the checkpoint holds shards.
  def place(x):
    spec = P("data") if x.ndim == 2 else P()
    return jax.device_put(x, NamedSharding(mesh, spec))
  return jax.tree.map(place, state)


def train_step(state, batch):
  def loss_fn(params):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(state["params"])
  updates, opt = TX.update(grads, state["opt"], state["params"])
  return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
           "step": state["step"] + 1}, {"loss": loss})


def make_batches(n):
  rng = np.random.default_rng(1)
  true_w = rng.normal(size=(D_IN, D_OUT)).astype(np.float32)
  out = []
  for _ in range(n):
    x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
    out.append({"x": x, "y": (x @ true_w).astype(np.float32)})
  return out


class SlowSource:
  """A Grain-like iterator: ``get_state``/``set_state``; sleeps while reading."""

  def __init__(self, batches, sleep_s, sleep_at):
    self.batches, self.sleep_s, self.sleep_at, self.i = batches, sleep_s, sleep_at, 0

  def __iter__(self):
    return self

  def __next__(self):
    if self.i >= len(self.batches):
      raise StopIteration
    if self.sleep_s and self.sleep_at == self.i:
      print(f"SLEEPING {self.i}", flush=True)  # the parent may signal now
      time.sleep(self.sleep_s)
    elif self.sleep_s and self.sleep_at == -1:
      time.sleep(self.sleep_s)
    b = self.batches[self.i]
    self.i += 1
    return b

  def get_state(self):
    return {"index": self.i}

  def set_state(self, s):
    self.i = int(s["index"])


def digest(state) -> str:
  h = hashlib.sha256()
  for x in jax.tree.leaves(jax.device_get(state)):
    h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
  return h.hexdigest()


class Ready(loopkit.Hook):
  """Prints READY after the checkpoint hook restored (it runs after it)."""

  needs_state = False

  def __init__(self, ckpt):
    super().__init__()
    self.ckpt = ckpt

  def on_run_start(self, loop, state):
    step = -1 if self.ckpt is None or self.ckpt.restored_step is None else self.ckpt.restored_step
    self.devices = sorted({len(x.sharding.device_set) for x in jax.tree.leaves(state)})
    print(f"READY {step} {digest(state) if step >= 0 else '-'}", flush=True)


class KillingCheckpointHook(loopkit.CheckpointHook):
  """SIGKILLs its own process right after a save started (the write is in flight)."""

  kill_step = -1

  def on_trigger(self, info, state):
    super().on_trigger(info, state)
    if info.end_step == self.kill_step:
      os.kill(os.getpid(), signal.SIGKILL)


def kill_at_rmdir(step):
  """SIGKILLs the process when ``os.rmdir`` is called on a directory named ``step``: the moment
  a recursive delete of that step directory has removed everything inside it."""
  rmdir = os.rmdir

  def patched(path, *args, **kwargs):
    if os.path.basename(os.fsdecode(path)) == str(step):
      print(f"KILLED AT RMDIR {os.fsdecode(path)}", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    return rmdir(path, *args, **kwargs)

  os.rmdir = patched


def write(out, state, info):
  np.savez(out + ".tmp.npz", *[np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))])
  os.replace(out + ".tmp.npz", out + ".npz")
  with open(out + ".tmp.json", "w") as f:
    json.dump(info, f)
  os.replace(out + ".tmp.json", out + ".json")


def main(args):
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  state = init_state(mesh)
  if args.mode == "inspect":
    ckpt = loopkit.CheckpointHook(args.dir)
    r = ckpt.restore(state, args.step)
    shardings = [str(x.sharding.spec) + "@" + str(len(x.sharding.device_set))
                 for x in jax.tree.leaves(r.state)]
    write(args.out, r.state, {"step": r.step, "devices": jax.device_count(),
                              "shardings": shardings, "ledger": r.ledger.to_dict(),
                              "data_position": r.data_position})
    ckpt.close()
    return
  source = SlowSource(make_batches(args.num_steps), args.sleep_ms / 1000, args.sleep_at_batch)
  hooks: list = []
  ckpt = None
  digests: dict[int, str] = {}
  if args.mode == "train":
    ckpt = KillingCheckpointHook(args.dir, every_steps=args.every_steps,
                                 max_to_keep=args.max_to_keep,
                                 **({} if args.keep_every_steps is None
                                    else {"keep_every_steps": args.keep_every_steps}))
    ckpt.kill_step = args.kill_after_save_step
    if args.kill_at_rmdir >= 0:
      kill_at_rmdir(args.kill_at_rmdir)
    hooks.append(ckpt)
  else:
    hooks.append(loopkit.CallbackHook(
        lambda info, s: digests.__setitem__(info.end_step, digest(s)),
        every_steps=args.every_steps))
  ready = Ready(ckpt)
  hooks.append(ready)
  loop = loopkit.TrainLoop(train_step, iterations_per_loop=args.k, hooks=hooks, mesh=mesh,
                           prefetch=args.prefetch)
  final = loop.run(state, source, num_steps=args.num_steps)
  info = {"status": loop.status, "step": loop.ledger.step,
          "restored_step": None if ckpt is None else ckpt.restored_step,
          "saved_steps": [] if ckpt is None else ckpt.saved_steps,
          "all_steps": [] if ckpt is None else ckpt.all_steps(),
          "digests": digests, "compile_count": loop.program.compile_count(),
          "final_digest": digest(final), "state_devices": ready.devices,
          "finite": bool(all(np.isfinite(np.asarray(x)).all()
                             for x in jax.tree.leaves(jax.device_get(final))))}
  write(args.out, final, info)


if __name__ == "__main__":
  main(ARGS)
