"""Does the prefetch thread hide input time behind device time?

A deliberately slow Python source (a fixed ``time.sleep`` per batch, standing in
for decoding or augmentation) feeds a ``TrainLoop`` whose step costs about as
much device time per step. With prefetch the host forms and transfers the next
chunk ``[K, B, ...]`` while the device runs the current one, so the wall time
should be close to ``max(data, compute)``, not ``data + compute``.

Usage (from the repository root)::

  python benchmarks/input_overlap.py                      # 200 steps, 10 ms per batch
  python benchmarks/input_overlap.py --steps 400 --sleep-ms 5 --k 10

Measured, each after a warm-up run (compilation excluded):
  * data:    the host side alone: the source (steps x sleep), stacking the
    chunks and transferring them (a ``ChunkFeeder`` drained with no compute);
  * compute: the loop fed from batches already in memory;
  * serial:  the slow source, ``prefetch=0`` and a hook that blocks on the
    state after every call (no overlap: expect about data + compute);
  * async dispatch only: ``prefetch=0``; the host still forms chunk i+1 while
    the device runs chunk i, because dispatch is asynchronous and metrics
    are fetched one call late;
  * prefetch=2: the background thread as well (expect about the max).

Printed ratio: ``overlap / max(data, compute)`` (1.0 is perfect overlap; the
first chunk of K batches cannot overlap anything, so expect about
``1 + K / steps`` plus the per-call overhead). The step's cost is calibrated
to ``--sleep-ms`` first (a chain of ``tanh(x @ w)`` matmuls).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--sleep-ms", type=float, default=10.0, help="host time per batch")
  p.add_argument("--k", type=int, default=5, help="iterations_per_loop")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--hidden", type=int, default=256)
  args = p.parse_args(argv)

  sys.path.insert(0, ROOT)
  import jax
  import jax.numpy as jnp
  import numpy as np

  import loopkit
  from loopkit.data.feeding import ChunkFeeder

  sleep_s = args.sleep_ms / 1000
  rng = np.random.default_rng(0)
  pool = [{"x": rng.normal(size=(args.batch, args.hidden)).astype(np.float32)}
          for _ in range(8)]

  def slow_source(n):
    for i in range(n):
      time.sleep(sleep_s)  # releases the GIL, like I/O or a C decoder would
      yield pool[i % len(pool)]

  def make_step(reps):
    def step(state, batch):
      x = jax.lax.fori_loop(0, reps, lambda _, x: jnp.tanh(x @ state["w"]), batch["x"])
      return ({"step": state["step"] + 1, "w": state["w"], "acc": state["acc"] + jnp.mean(x)},
              {"m": jnp.mean(x)})
    return step

  def init():
    w = rng.normal(size=(args.hidden, args.hidden)).astype(np.float32) / np.sqrt(args.hidden)
    return {"step": jnp.zeros((), jnp.int32), "w": jnp.asarray(w), "acc": jnp.zeros(())}

  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])

  def timed_run(loop, batches):
    t0 = time.perf_counter()
    out = loop.run(init(), batches, num_steps=args.steps)
    jax.block_until_ready(out)
    return time.perf_counter() - t0

  def compute_time(reps):
    loop = loopkit.TrainLoop(make_step(reps), iterations_per_loop=args.k, mesh=mesh)
    batches = [pool[i % len(pool)] for i in range(args.steps)]
    timed_run(loop, batches)  # compile + warm
    return loop, min(timed_run(loop, batches) for _ in range(2))

  # calibrate the step to cost about sleep_ms per step
  reps = 4
  for _ in range(3):
    _, t = compute_time(reps)
    per_step = t / args.steps
    new = max(1, round(reps * sleep_s / per_step))
    if abs(new - reps) <= max(1, reps // 20):
      break
    reps = new
  loop, compute = compute_time(reps)

  t0 = time.perf_counter()
  for _ in slow_source(args.steps):
    pass
  sleep_only = time.perf_counter() - t0
  # the whole host side without compute: source + stacking + transfer, per chunk
  t0 = time.perf_counter()
  feeder = ChunkFeeder(slow_source(args.steps), itertools.repeat(args.k),
                       iterations_per_loop=args.k, batch_sharding=loop.program.batch_sharding,
                       replicated=loop.program.replicated, data_parallel_size=1, prefetch=0)
  while (chunk := feeder.next()) is not None and chunk.length:
    jax.block_until_ready(chunk.batches)
    if chunk.exhausted:
      break
  feeder.close()
  data = time.perf_counter() - t0

  class BlockEveryCall(loopkit.Hook):
    """Waits for the device after every call: a loop with no overlap at all."""

    def on_trigger(self, info, state):
      jax.block_until_ready(state)

  def warmed(prefetch, hooks=()):
    lp = loopkit.TrainLoop(make_step(reps), iterations_per_loop=args.k, mesh=mesh,
                           prefetch=prefetch, hooks=list(hooks))
    lp.run(init(), [pool[0]] * args.k, num_steps=args.k)  # compile
    return lp

  serial = timed_run(warmed(0, [BlockEveryCall()]), slow_source(args.steps))
  async_only = timed_run(warmed(0), slow_source(args.steps))
  overlap = min(timed_run(loop, slow_source(args.steps)) for _ in range(2))
  buckets = {k: round(v, 3) for k, v in loop.ledger.seconds.items()}

  best, total = max(data, compute), data + compute
  result = {
      "steps": args.steps, "k": args.k, "sleep_ms": args.sleep_ms, "matmul_reps": reps,
      "device": str(jax.devices()[0]), "sleep_only_s": sleep_only, "data_s": data,
      "compute_s": compute, "prefetch2_ledger_seconds": buckets,
      "serial_s": serial, "async_dispatch_only_s": async_only, "overlap_s": overlap,
      "ratio_to_max": overlap / best, "ratio_to_sum": overlap / total,
  }
  print(f"{args.steps} steps, K={args.k}, {args.sleep_ms:g} ms sleep per batch, "
        f"step = {reps} x tanh(x @ w) [{args.batch}x{args.hidden}] on {jax.devices()[0]}")
  rows = [("sleeps alone", sleep_only), ("data alone (+ stack, transfer)", data),
          ("compute alone", compute),
          ("serial (prefetch=0, block each call)", serial),
          ("async dispatch only (prefetch=0)", async_only), ("prefetch=2", overlap)]
  for name, t in rows:
    print(f"  {name:38s} {t:7.3f} s  {t / best:5.2f} x max  {t / total:5.2f} x sum")
  print(f"  ledger seconds of the last prefetch=2 run: {buckets}")
  print(f"overlap ratio (prefetch=2 wall / max(data, compute)): {overlap / best:.3f}")
  return result


if __name__ == "__main__":
  main()
