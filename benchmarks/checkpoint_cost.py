"""What does an asynchronous checkpoint cost in step time?

Trains an MLP (Adam; the state is about 3x the parameters) with
``iterations_per_loop=K`` three ways, each after a warm-up run (compilation
excluded) and each into a fresh directory:

  * none:  no checkpoint hook;
  * async: ``CheckpointHook(every_steps=E)`` (Orbax async checkpointing: the hook
    returns once the arrays are copied off the device; files are written by
    background threads while training continues);
  * sync:  the same with ``async_save=False`` (the hook returns when the files
    are committed), for comparison.

Printed per mode: wall time per step (ms, including the wait for the last
write at the end of the run), the time the loop spent inside the hook per
save (ms: the blocking part, plus the wait for the last write at the end),
and the ratio ``step time / step time without checkpoints``. The ratio
printed last, ``async ratio``, is the headline.

Usage (from the repository root)::

  python benchmarks/checkpoint_cost.py                 # 240 steps, K=10, save every 40
  python benchmarks/checkpoint_cost.py --hidden 2048 --every 20 --dir /fast/disk

The directory defaults to a temporary one under ``$TMPDIR`` (local disk).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=240, help="measured steps per mode")
  p.add_argument("--k", type=int, default=10, help="iterations_per_loop")
  p.add_argument("--every", type=int, default=40, help="checkpoint every this many steps")
  p.add_argument("--hidden", type=int, default=1024, help="MLP width (4 layers)")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--repeats", type=int, default=2, help="measured runs per mode (best kept)")
  p.add_argument("--dir", default=None, help="checkpoint root (default: a temp dir)")
  args = p.parse_args(argv)

  sys.path.insert(0, ROOT)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import loopkit

  tx = optax.adam(1e-3)
  h = args.hidden
  sizes = [(h, h)] * 4

  def init_state():
    keys = jax.random.split(jax.random.key(0), len(sizes))
    params = [{"w": jax.random.normal(k, s) / np.sqrt(s[0]), "b": jnp.zeros((s[1],))}
              for k, s in zip(keys, sizes, strict=True)]
    return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

  def train_step(state, batch):
    def loss_fn(params):
      x = batch["x"]
      for layer in params:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
      return jnp.mean((x - batch["y"]) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
             "step": state["step"] + 1}, {"loss": loss})

  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(args.batch, h)).astype(np.float32),
           "y": rng.normal(size=(args.batch, h)).astype(np.float32)}
  n_params = sum(int(np.prod(s)) + s[1] for s in sizes)
  state_mb = 3 * n_params * 4 / 2**20
  root = args.dir or tempfile.mkdtemp(prefix="loopkit_ckpt_cost_")
  os.makedirs(root, exist_ok=True)
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; state {state_mb:.1f} MiB; "
        f"K={args.k}; {args.steps} steps; save every {args.every} -> "
        f"{args.steps // args.every} saves per run; dir {root}", flush=True)

  results = {}
  for mode in ("none", "async", "sync"):
    hooks = []
    if mode != "none":
      ckpt = loopkit.CheckpointHook(os.path.join(root, mode, "warmup"), every_steps=args.every,
                                    async_save=mode == "async", restore=False)
      hooks = [ckpt]
    loop = loopkit.TrainLoop(train_step, iterations_per_loop=args.k, hooks=hooks)
    state = loop.run(init_state(), iter(lambda: batch, None), num_steps=args.k)  # compile
    best = None
    for r in range(args.repeats):
      if hooks:
        hooks[0].directory = hooks[0].directory.parent / f"run{r}"
      start = int(state["step"])
      hook_s0 = loop.ledger.seconds.get("checkpoint", 0.0)
      saved0 = len(hooks[0].saved_steps) if hooks else 0
      jax.block_until_ready(state)
      t0 = time.perf_counter()
      state = loop.run(state, iter(lambda: batch, None), num_steps=start + args.steps)
      jax.block_until_ready(state)
      wall = time.perf_counter() - t0
      saves = len(hooks[0].saved_steps) - saved0 if hooks else 0
      hook_ms = 1e3 * (loop.ledger.seconds.get("checkpoint", 0.0) - hook_s0) / max(saves, 1)
      if best is None or wall < best[0]:
        best = (wall, hook_ms, saves)
    wall, hook_ms, saves = best
    results[mode] = {"ms_per_step": 1e3 * wall / args.steps, "hook_ms_per_save": hook_ms,
                     "saves": saves}
  base = results["none"]["ms_per_step"]
  for mode, r in results.items():
    r["ratio"] = r["ms_per_step"] / base
    print(f"{mode:>5}: {r['ms_per_step']:.2f} ms/step, {r['saves']} saves, "
          f"{r['hook_ms_per_save']:.1f} ms in the hook per save, ratio {r['ratio']:.3f}",
          flush=True)
  print(f"async ratio: {results['async']['ratio']:.3f} "
        f"(sync ratio: {results['sync']['ratio']:.3f})", flush=True)
  if args.dir is None:
    shutil.rmtree(root, ignore_errors=True)
  return results


if __name__ == "__main__":
  main()
