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

The modes are interleaved over ``--repeats`` rounds (so clock or load drifts
hit all alike) and the best run of each is kept. Printed per mode: wall time
per step (ms, including the wait for the last write at the end of the run),
the median time a save blocks the loop (ms, inside the hook's ``on_trigger``),
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
  p.add_argument("--hidden", type=int, default=1024, help="MLP width (4 layers: d-h-h-h-d)")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--in-dim", type=int, default=64, help="input and target width")
  p.add_argument("--repeats", type=int, default=3, help="measured runs per mode (best kept)")
  p.add_argument("--dir", default=None, help="checkpoint root (default: a temp dir)")
  args = p.parse_args(argv)

  sys.path.insert(0, ROOT)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import loopkit

  tx = optax.adam(1e-3)
  h, d = args.hidden, args.in_dim
  sizes = [(d, h), (h, h), (h, h), (h, d)]  # small input and target: compute-bound, not input-bound

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
  batch = {"x": rng.normal(size=(args.batch, d)).astype(np.float32),
           "y": rng.normal(size=(args.batch, d)).astype(np.float32)}
  n_params = sum(int(np.prod(s)) + s[1] for s in sizes)
  state_mb = 3 * n_params * 4 / 2**20
  root = args.dir or tempfile.mkdtemp(prefix="loopkit_ckpt_cost_")
  os.makedirs(root, exist_ok=True)
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; state {state_mb:.1f} MiB; "
        f"K={args.k}; {args.steps} steps; save every {args.every} -> "
        f"{args.steps // args.every} saves per run; dir {root}", flush=True)

  loops, hooks, after_call_s = {}, {}, {}
  for mode in ("none", "async", "sync"):
    hook = None
    if mode != "none":
      hook = loopkit.CheckpointHook(os.path.join(root, mode, "warmup"), every_steps=args.every,
                                    async_save=mode == "async", restore=False)
      after_call_s[mode] = []

      def timed(info, state, _hook=hook, _orig=hook.on_trigger, _log=after_call_s[mode]):
        t0 = time.perf_counter()
        _orig(info, state)
        _log.append(time.perf_counter() - t0)
      hook.on_trigger = timed
    hooks[mode] = hook
    loops[mode] = loopkit.TrainLoop(train_step, iterations_per_loop=args.k,
                                    hooks=[hook] if hook else [])
  states = {m: loop.run(init_state(), iter(lambda: batch, None), num_steps=args.k)  # compile
            for m, loop in loops.items()}
  walls = {m: [] for m in loops}
  per_save = {m: [] for m in loops}
  for r in range(args.repeats):  # modes interleaved, so drifts (clocks, load) hit all alike
    for mode, loop in loops.items():
      hook = hooks[mode]
      if hook is not None:
        hook.directory = hook.directory.parent / f"run{r}"
        after_call_s[mode].clear()
      start = int(states[mode]["step"])
      jax.block_until_ready(states[mode])
      t0 = time.perf_counter()
      states[mode] = loop.run(states[mode], iter(lambda: batch, None),
                              num_steps=start + args.steps)
      jax.block_until_ready(states[mode])
      walls[mode].append(time.perf_counter() - t0)
      if hook is not None:
        per_save[mode].append(1e3 * float(np.median(after_call_s[mode])))
  results = {}
  for mode in loops:
    wall = min(walls[mode])
    results[mode] = {"ms_per_step": 1e3 * wall / args.steps,
                     "ms_per_step_all": [round(1e3 * w / args.steps, 2) for w in walls[mode]],
                     "hook_ms_per_save": float(np.median(per_save[mode] or [0.0])),
                     "saves": len(after_call_s.get(mode, []))}
  base = results["none"]["ms_per_step"]
  for mode, r in results.items():
    r["ratio"] = r["ms_per_step"] / base
    print(f"{mode:>5}: {r['ms_per_step']:.2f} ms/step (runs: {r['ms_per_step_all']}), "
          f"{r['saves']} saves per run, {r['hook_ms_per_save']:.1f} ms blocking per save "
          f"(median), ratio {r['ratio']:.3f}", flush=True)
  print(f"async ratio: {results['async']['ratio']:.3f} "
        f"(sync ratio: {results['sync']['ratio']:.3f})", flush=True)
  if args.dir is None:
    shutil.rmtree(root, ignore_errors=True)
  return results


if __name__ == "__main__":
  main()
